"""The paper's long-tail figure: test metric per item-popularity bucket, per method and epsilon.

Items are sorted by training count and cut into five equal buckets (trainer.evaluate: 0 = the
rarest fifth, 4 = the most popular); the test metric of every bucket comes with every run. The
runs are the privacy-utility experiment's test runs (tuned settings, `--seeds` seeds): the same
cells, computed only if that experiment has not recorded them yet.
"""

from __future__ import annotations

import math

import numpy as np

from bench import harness, privacy_utility, training

NAME = "long-tail"


def sliced(group: dict) -> np.ndarray:
    """Test metric per [seed, bucket] (NaN for a bucket without test rows)."""
    return np.array([[math.nan if x is None else x for x in v["test_sliced"]] for v in group["tests"]], dtype=float)


def bucket_means(values: np.ndarray) -> np.ndarray:
    """Mean over seeds of every bucket, NaN where no seed has test rows in it."""
    return np.array([col[~np.isnan(col)].mean() if np.any(~np.isnan(col)) else math.nan for col in values.T])


def plot(collected: dict, protocol: str):
    """One panel per epsilon: bucket on x, one mean ± std band per private method, top lines dashed."""
    metric = training.METRICS[protocol]
    epsilons = collected["size"]["epsilons"]
    fig, axes = harness.new_figure(len(epsilons), width=4.5)
    buckets = np.arange(training.BUCKETS)
    for ax, eps in zip(axes, epsilons, strict=True):
        for (name, group_eps), group in collected["groups"].items():
            label = training.METHODS[name].label
            if group_eps == eps:
                harness.mean_std_band(ax, buckets, sliced(group), label, color=training.color(name))
            elif group_eps is None:
                ax.plot(
                    buckets,
                    bucket_means(sliced(group)),
                    linestyle="--",
                    color=training.color(name),
                    label=f"{label} (mean)",
                )
        ax.set_xticks(buckets)
        harness.finish(
            ax,
            f"epsilon = {eps:g}",
            "item popularity bucket, 0 = rarest fifth (bucket)",
            f"test {metric.name} ({metric.unit})",
        )
    return fig


def extremes(collected: dict, protocol: str) -> list[str]:
    """Per epsilon, the best private method on the rarest and on the most popular bucket."""
    metric = training.METRICS[protocol]
    lines = []
    for eps in collected["size"]["epsilons"]:
        means = {name: bucket_means(sliced(g)) for (name, e), g in collected["groups"].items() if e == eps}
        parts = []
        for bucket, what in ((0, "rarest"), (training.BUCKETS - 1, "most popular")):
            scored = {n: m[bucket] for n, m in means.items() if not math.isnan(m[bucket])}
            if scored:
                best = (min if metric.lower_is_better else max)(scored, key=scored.get)
                parts.append(f"{what} fifth: {training.METHODS[best].label} ({scored[best]:.4f})")
        lines.append(f"epsilon = {eps:g}: best on the " + ", on the ".join(parts) + ".")
    return lines


@harness.experiment(
    NAME, "test metric per item-popularity bucket (5) per method and epsilon, from the privacy-utility runs"
)
def run(ctx: harness.Context) -> harness.Section:
    collected = privacy_utility.collect(ctx)
    metric = training.METRICS[ctx.protocol]
    figure = harness.save_figure(plot(collected, ctx.protocol), ctx.out, f"long_tail_{ctx.protocol}.png")
    section = harness.Section(f"Quality on the long tail ({ctx.protocol} protocol)")
    section.text(
        f"The privacy-utility experiment's test runs (tuned settings, {ctx.seeds} seeds), their test {metric.name} per "
        "item-popularity "
        "bucket: items sorted by training count, five equal buckets, 0 = the rarest fifth. Same setup as that section."
    )
    rows = []
    for (name, eps), group in collected["groups"].items():
        values = sliced(group)
        cells = [
            "-" if np.all(np.isnan(col)) else "{:.4f} ± {:.4f}".format(*training.mean_std(col[~np.isnan(col)]))
            for col in values.T
        ]
        rows.append([training.METHODS[name].label, "non-private" if eps is None else f"{eps:g}"] + cells)
    section.table(["method", "epsilon"] + [f"bucket {b}" for b in range(training.BUCKETS)], rows)
    section.figure(
        figure,
        f"Test {metric.name} per popularity bucket, one panel per epsilon (mean ± std over seeds; non-private dashed).",
    )
    section.text("**What it shows:** " + " ".join(extremes(collected, ctx.protocol)))
    return section
