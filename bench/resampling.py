"""The paper's SSP1 vs SSP2 comparison: how often the statistics' noise is resampled, at fixed privacy.

AM-SSP with the public features encoder only (no item-id embedding) and one outer step (the paper
optimizes the public encoder alone, without alternating minimization), `epochs` training epochs;
the statistics are released R times, each with its own noise, and the epochs split into R phases
(trainer.ssp). The whole run's epsilon is fixed, so the accountant gives each of the R releases
more noise as R grows. R = 1 is SSP2 (noise added once, statistics reused); R = epochs is SSP1
(fresh noise every epoch). Defaults otherwise (not tuned), `--seeds` seeds per point.
"""

from __future__ import annotations

import numpy as np

from bench import harness, training

NAME = "resampling"


def sizes(quick: bool) -> dict:
    config = {"outer_steps": 1, "epochs": 16, "item_id_feature": False}
    return {"epsilons": [1.0, 10.0], "resamples": [1, 4, 16] if quick else [1, 2, 4, 8, 16], "config": config}


def cell_list(data: str, protocol: str, size: dict, seeds: int) -> list[dict]:
    return [
        training.cell_params(
            data,
            protocol,
            "ssp",
            eps,
            training.cell_config("ssp", {}, {**size["config"], "resamples": r}),
            training.TEST_SEED + s,
        )
        for eps in size["epsilons"]
        for r in size["resamples"]
        for s in range(seeds)
    ]


def grid(values: list[dict], size: dict, seeds: int) -> np.ndarray:
    """Test metric as [epsilon, seed, resamples] (the order of `cell_list`)."""
    return (
        np.array([v["test"] for v in values], dtype=float)
        .reshape(len(size["epsilons"]), len(size["resamples"]), seeds)
        .transpose(0, 2, 1)
    )


def plot(size: dict, metric_grid: np.ndarray, protocol: str):
    metric = training.METRICS[protocol]
    fig, (ax,) = harness.new_figure(width=6.5)
    for eps, ys in zip(size["epsilons"], metric_grid, strict=True):
        harness.mean_std_band(ax, size["resamples"], ys, f"epsilon = {eps:g}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(size["resamples"], [str(r) for r in size["resamples"]])
    harness.finish(
        ax,
        f"SSP2 (R = 1) to SSP1 (R = {size['config']['epochs']}), public features encoder",
        f"noise resamples R over {size['config']['epochs']} epochs (releases)",
        f"test {metric.name} ({metric.unit})",
    )
    return fig


@harness.experiment(
    NAME,
    "SSP1 vs SSP2: resampling the statistics' noise R in {1..16} times at fixed total privacy (public features "
    "encoder)",
)
def run(ctx: harness.Context) -> harness.Section:
    section = harness.Section(f"Comparing SSP1 and SSP2 ({ctx.protocol} protocol)")
    if "ssp" not in training.select(ctx.methods):
        section.text("Not run: AM-SSP (`ssp`) is not among the selected methods.")
        return section
    size, metric = sizes(ctx.quick), training.METRICS[ctx.protocol]
    values = ctx.results.run(
        NAME,
        cell_list(training.data_of(ctx.data), ctx.protocol, size, ctx.seeds),
        lambda p: training.run_cell(ctx.out, p),
        ctx.progress,
    )
    metric_grid = grid(values, size, ctx.seeds)
    figure = harness.save_figure(plot(size, metric_grid, ctx.protocol), ctx.out, f"resampling_{ctx.protocol}.png")
    section.text(
        f"AM-SSP, features encoder without the item id, one outer step of {size['config']['epochs']} epochs, user "
        "level, delta = "
        f"{training.DELTA:g}, other settings at their defaults; the statistics are released R times at a fixed total "
        "epsilon "
        f"(R = 1: SSP2; R = {size['config']['epochs']}: SSP1, fresh noise every epoch); {ctx.seeds} seeds per point."
    )
    rows = []
    for eps, ys in zip(size["epsilons"], metric_grid, strict=True):
        rows.append(
            [f"{eps:g}"]
            + [f"{m:.4f} ± {s:.4f}" for m, s in (training.mean_std(ys[:, k]) for k in range(len(size["resamples"])))]
        )
    section.table(["epsilon"] + [f"R = {r}" for r in size["resamples"]], rows)
    section.figure(figure, f"Test {metric.name} against the number of noise resamples R (mean ± std over seeds).")
    changes = []
    for eps, ys in zip(size["epsilons"], metric_grid, strict=True):
        first, last = ys[:, 0].mean(), ys[:, -1].mean()
        worse = metric.better(first, last)
        changes.append(
            f"at epsilon = {eps:g}, going from R = 1 to R = {size['resamples'][-1]} changes test {metric.name} by "
            f"{last - first:+.4f} "
            f"({'worse' if worse else 'not worse'})"
        )
    section.text(
        "**What it shows:** "
        + "; ".join(changes)
        + ". The paper expects quality to degrade as R grows, more so at small epsilon."
    )
    return section
