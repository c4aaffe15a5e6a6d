"""The paper's time-evolution figure: test metric against wall-clock time, AM-SSP against AM-DPSGD.

Both methods run at one epsilon, the privacy-utility epsilon nearest TARGET_EPSILON (on a log
scale), with their tuned settings: the configuration the privacy-utility search chose when all its
trials are recorded in OUT (its test cells are then shared, not rerun), else the method's defaults
(cells of this experiment). A run's trajectory (bench.training) gives the test metric after every
outer step at the wall time that step finished, so one run per seed draws the whole curve.

Time to quality: the target is the less good of the two methods' best mean metrics over their
trained steps (s >= 1), so both reach it; a method's time is the wall time of its first trained
step whose mean metric is at least as good (the curve between steps is not observed, so nothing is
interpolated). Step 0, the initial encoder (public features only, before any private update), is
drawn but does not count: a method does not "reach" a quality before it has trained.
"""

from __future__ import annotations

import math

import numpy as np

from bench import harness, privacy_utility, training

NAME = "time-to-quality"
METHODS = ("ssp", "dpsgd")
TARGET_EPSILON = 10.0


def epsilon_of(size: dict) -> float:
    """The privacy-utility epsilon nearest TARGET_EPSILON (log scale): its tuning cells can be reused."""
    return min(size["epsilons"], key=lambda e: abs(math.log(e / TARGET_EPSILON)))


def curves(ctx: harness.Context) -> dict:
    """Per method: whether tuned, its config and its cells (computed when missing), at `epsilon_of`."""
    size = privacy_utility.sizes(ctx.quick)
    data, epsilon = training.data_of(ctx.data), epsilon_of(size)
    out = {}
    for name in [n for n in training.select(ctx.methods) if n in METHODS and training.available(n)]:
        config = privacy_utility.tuned_config(ctx.results, data, ctx.protocol, name, epsilon, size)
        tuned = config is not None
        config = config if tuned else training.cell_config(name, size["base"], {})
        params = privacy_utility.test_params(data, ctx.protocol, name, epsilon, config, ctx.seeds)
        cells = ctx.results.run(
            privacy_utility.NAME if tuned else NAME,
            params,
            lambda p: training.run_cell(ctx.out, p),
            ctx.progress,
            f"{NAME}: {training.METHODS[name].label}",
        )
        out[name] = {"tuned": tuned, "config": config, "cells": cells}
    return out


def mean_curve(cells: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(mean time of every outer step over seeds, test metric per seed and step)."""
    return (
        np.mean([[p["seconds"] for p in c["trajectory"]] for c in cells], axis=0),
        np.array([[p["test"] for p in c["trajectory"]] for c in cells], dtype=float),
    )


def time_to_reach(times, values, target: float, lower_is_better: bool) -> float | None:
    """Time of the first trained step (index >= 1) at least as good as `target`; None if none is."""
    for t, v in zip(times[1:], values[1:], strict=True):
        if (v <= target) if lower_is_better else (v >= target):
            return float(t)
    return None


def common_target(means: dict, lower_is_better: bool) -> float:
    """The metric every curve reaches: the less good of their best trained steps (index >= 1)."""
    bests = [min(m[1:]) if lower_is_better else max(m[1:]) for m in means.values()]
    return max(bests) if lower_is_better else min(bests)


def summarize(results: dict, protocol: str) -> dict:
    """Target, per-method time to reach it, and the AM-DPSGD / AM-SSP ratio (None without both)."""
    metric = training.METRICS[protocol]
    means = {name: mean_curve(r["cells"]) for name, r in results.items()}
    target = common_target({n: v.mean(axis=0) for n, (_, v) in means.items()}, metric.lower_is_better)
    times = {n: time_to_reach(t, v.mean(axis=0), target, metric.lower_is_better) for n, (t, v) in means.items()}
    ratio = times["dpsgd"] / times["ssp"] if {"dpsgd", "ssp"} <= times.keys() else None
    return {"target": target, "times": times, "ratio": ratio, "curves": means}


def plot(summary: dict, protocol: str, epsilon: float, seeds: int):
    metric = training.METRICS[protocol]
    fig, (ax,) = harness.new_figure(width=6.5)
    for name, (times, values) in summary["curves"].items():
        harness.mean_std_band(
            ax,
            times,
            values,
            f"{training.METHODS[name].label}, outer steps 0..{len(times) - 1}",
            color=training.color(name),
        )
    ax.axhline(
        summary["target"], color="black", linestyle=":", label=f"common target {metric.name} {summary['target']:.4f}"
    )
    ax.set_xscale("log")
    harness.finish(
        ax,
        f"Test {metric.name} during training, epsilon = {epsilon:g} ({seeds} seeds)",
        "wall-clock time since the run started (s)",
        f"test {metric.name} ({metric.unit})",
    )
    return fig


@harness.experiment(
    NAME,
    "test metric vs wall-clock time for AM-SSP and AM-DPSGD at their tuned settings, and the time ratio to the same "
    "metric",
)
def run(ctx: harness.Context) -> harness.Section:
    results = curves(ctx)
    section = harness.Section(f"Time to quality: AM-SSP vs AM-DPSGD ({ctx.protocol} protocol)")
    missing = [training.METHODS[n].label for n in METHODS if n not in results]
    if not results:
        section.text(f"Nothing to run: none of {', '.join(missing)} is selected and offered by pipelines.training.")
        return section
    metric = training.METRICS[ctx.protocol]
    summary, epsilon = summarize(results, ctx.protocol), epsilon_of(privacy_utility.sizes(ctx.quick))
    figure = harness.save_figure(
        plot(summary, ctx.protocol, epsilon, ctx.seeds), ctx.out, f"time_to_quality_{ctx.protocol}.png"
    )
    section.text(
        f"Both methods at epsilon = {epsilon:g} (user level, delta = {training.DELTA:g}), {ctx.seeds} seeds each; each "
        "point is the test "
        f"{metric.name} after an outer step (step 0: the initial encoder, public features only), at the mean wall time "
        "(2 cores, shared "
        "Spark session) that step finished. Settings: the privacy-utility search's choice where all its trials are in "
        "this folder "
        "(then its test runs are the ones shown), else the method's defaults. Target: the less good of the methods' "
        "best mean over "
        "their trained steps; time to it: the first trained step (s >= 1) at least as good, so step 0 never counts."
    )
    rows, untrained_better = [], []
    for name, r in results.items():
        times, values = summary["curves"][name]
        mean, std = training.mean_std(values[:, -1])
        reach = summary["times"][name]
        rows.append(
            [
                training.METHODS[name].label,
                "tuned (privacy-utility)" if r["tuned"] else "defaults",
                {k: v for k, v in r["config"].items() if k not in training.METHODS[name].overrides},
                f"{values[:, 0].mean():.4f}",
                f"{mean:.4f} ± {std:.4f}",
                f"{times[-1]:.1f}",
                "not reached" if reach is None else f"{reach:.1f}",
            ]
        )
        if metric.better(values[:, 0].mean(), mean):
            untrained_better.append(training.METHODS[name].label)
    section.table(
        [
            "method",
            "settings",
            "config",
            f"step 0 test {metric.name}",
            f"final test {metric.name}",
            "total time (s)",
            f"time to {metric.name} {summary['target']:.4f} (s)",
        ],
        rows,
    )
    section.figure(figure, f"Test {metric.name} against wall-clock time (mean ± std over seeds; log time axis).")
    if untrained_better:
        section.text(
            f"**Note:** the final model of {', '.join(untrained_better)} is worse on test than its step-0 encoder "
            "(public features "
            "only, before any private update)."
        )
    if summary["ratio"] is not None:
        section.text(
            f"**Ratio.** AM-DPSGD takes {summary['ratio']:.1f}x the time AM-SSP takes to reach test {metric.name} "
            f"{summary['target']:.4f}."
        )
    else:
        section.text(
            f"**Ratio:** not computed: {', '.join(missing) or 'a method'} did not run (pipelines.training has no such "
            "item update yet, or it "
            "was not selected)."
        )
    return section
