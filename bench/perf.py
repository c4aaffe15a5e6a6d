"""The performance benchmarks in the harness: stats-job throughput and trainer memory, against their targets.

1. bench.stats_throughput (its functions, at the sizes below): on synthetic power-law data, the
   numpy stats kernel's rate (2 rows d^2 flops / s) against this machine's single-thread GEMM rate
   (target: at least KERNEL_TARGET of it), and the Spark stats job's end-to-end time against the
   kernel's (target: at most SPARK_TARGET times), the Spark job on the bench's shared local session.
2. bench.trainer_memory: the SSP trainer's peak resident memory (a child interpreter's own VmHWM)
   for one epoch over random statistics of a small and a 10x larger catalog (targets: under
   MEMORY_LIMIT_MIB, and not growing with the catalog).
Both are timings of this machine at the time of the run (2 shared cores here): the report gives
ratios measured in the same cell, as the two scripts do.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

from bench import harness, training

NAME = "perf"
MEMORY_LIMIT_MIB = 2048.0  # bench.trainer_memory's default target


def sizes(quick: bool) -> dict:
    """Quick: a smoke run, at which fixed costs dominate and the targets do not apply."""
    if quick:
        return {
            "stats": {
                "rows": 100_000,
                "ratings_per_user": 30,
                "items": 5_000,
                "dim": 32,
                "alpha": 1.0,
                "seed": 0,
                "gemm_n": 1000,
                "repeats": 1,
                "shards": 4,
                "spark_runs": 1,
            },
            "memory": {"items": [2_000, 20_000], "dim": 16},
        }
    # the two scripts' own defaults, at which their targets are set (about 1 and 3 minutes here; the
    # memory run writes 8.6 GB of statistics to a temporary folder)
    return {
        "stats": {
            "rows": 2_000_000,
            "ratings_per_user": 30,
            "items": 20_000,
            "dim": 64,
            "alpha": 1.0,
            "seed": 0,
            "gemm_n": 3000,
            "repeats": 3,
            "shards": 4,
            "spark_runs": 3,
        },
        "memory": {"items": [50_000, 500_000], "dim": 64},
    }


def stats_cell(params: dict) -> dict:
    """GEMM, kernel and Spark figures of bench.stats_throughput at `params`, with its two ratios."""
    from bench import stats_throughput as bench_stats
    from pipelines.releases.stats_core import StatsSettings

    settings = StatsSettings(params["dim"], clip_u=1.0, clip_y=5.0)  # as stats_throughput's main
    users = math.ceil(params["rows"] / params["ratings_per_user"])
    with tempfile.TemporaryDirectory(prefix="bench-perf-") as work:
        interactions, items = bench_stats.make_data(
            os.path.join(work, "data"),
            users,
            params["items"],
            params["ratings_per_user"],
            params["alpha"],
            params["seed"],
        )
        paths = bench_stats.make_inputs(interactions, items, work, params["dim"], params["seed"])
        rows = bench_stats.load_rows(paths, params["dim"])
        with bench_stats.blas_threads(1):
            gemm = bench_stats.measure_gemm(params["gemm_n"], params["repeats"])
            kernel = bench_stats.measure_kernel(rows, settings, params["repeats"])
        del rows
        training.spark()  # measure_spark then runs on the bench's session instead of starting its own
        saved = os.environ.get("PYSPARK_SUBMIT_ARGS")  # measure_spark sets it for a JVM it would start
        try:
            spark = bench_stats.measure_spark(paths, work, settings, "local[2]", params["shards"], params["spark_runs"])
        finally:
            if saved is None:
                os.environ.pop("PYSPARK_SUBMIT_ARGS", None)
            else:
                os.environ["PYSPARK_SUBMIT_ARGS"] = saved
    reported = bench_stats.reported_run(spark)
    return {
        "gemm_gflops": gemm["gflops"],
        "kernel_unsorted_gflops": kernel["unsorted_gflops"],
        "kernel_sorted_gflops": kernel["sorted_gflops"],
        "kernel_partition_gflops": kernel["partition_gflops"],
        "kernel_unsorted_s": kernel["unsorted_s"],
        "kernel_fraction": kernel["unsorted_gflops"] / gemm["gflops"],
        "spark_end_to_end_s": reported["end_to_end_s"],
        "spark_prepare_s": reported["prepare_s"],
        "spark_over_kernel": reported["end_to_end_s"] / kernel["unsorted_s"],
        "kernel_target": bench_stats.KERNEL_TARGET,
        "spark_target": bench_stats.SPARK_TARGET,
    }


def memory_cell(params: dict) -> dict:
    """bench.trainer_memory.measure for each catalog size (inputs written to a temporary folder)."""
    from bench import trainer_memory

    runs = []
    for items in params["items"]:
        folder = tempfile.mkdtemp(prefix="bench-trainer-mem-")
        try:
            runs.append(trainer_memory.measure(folder, items, params["dim"]))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return {"runs": runs, "limit_mib": MEMORY_LIMIT_MIB}


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def plot(stats: dict, memory: dict):
    """Left: GEMM and kernel rates with the kernel target; right: trainer peak memory against items."""
    fig, (rates, peaks) = harness.new_figure(2)
    names = ["GEMM", "kernel, file order", "kernel, item-sorted", "kernel, partition path"]
    values = [
        stats["gemm_gflops"],
        stats["kernel_unsorted_gflops"],
        stats["kernel_sorted_gflops"],
        stats["kernel_partition_gflops"],
    ]
    for k, (name, value) in enumerate(zip(names, values, strict=True)):
        rates.bar(k, value, color=f"C{k}", label=name)
    rates.axhline(
        stats["kernel_target"] * stats["gemm_gflops"],
        color="black",
        linestyle="--",
        label=f"target: {stats['kernel_target']:.0%} of GEMM",
    )
    rates.set_xticks(range(len(names)), [n.split(",")[0] for n in names])
    harness.finish(rates, "Stats kernel rate, one BLAS thread", "computation (kind)", "rate (GFLOP/s)")
    items = [r["items"] for r in memory["runs"]]
    peaks.plot(
        items,
        [r["peak_rss_mib"] for r in memory["runs"]],
        marker="o",
        label=f"SSP trainer, one epoch, d = {memory['runs'][0]['dim']}",
    )
    peaks.axhline(memory["limit_mib"], color="black", linestyle="--", label=f"target: {memory['limit_mib']:.0f} MiB")
    peaks.set_xscale("log")
    peaks.set_ylim(bottom=0)
    harness.finish(
        peaks, "Trainer peak memory against catalog size", "catalog items (items)", "peak resident memory (MiB)"
    )
    return fig


@harness.experiment(
    NAME, "stats-job throughput (kernel vs GEMM, Spark vs kernel) and trainer memory vs items, against their targets"
)
def run(ctx: harness.Context) -> harness.Section:
    size = sizes(ctx.quick)
    stats = ctx.results.run(
        NAME,
        [{"benchmark": "stats_throughput", **size["stats"]}],
        stats_cell,
        ctx.progress,
        f"{NAME}: stats throughput",
    )[0]
    memory = ctx.results.run(
        NAME, [{"benchmark": "trainer_memory", **size["memory"]}], memory_cell, ctx.progress, f"{NAME}: trainer memory"
    )[0]
    figure = harness.save_figure(plot(stats, memory), ctx.out, "perf.png")
    small, large = memory["runs"][0], memory["runs"][-1]
    growth = large["peak_rss_mib"] / small["peak_rss_mib"]
    section = harness.Section("Performance: stats job and trainer")
    s = size["stats"]
    section.text(
        f"`bench.stats_throughput` at {s['rows']:,} ratings ({s['ratings_per_user']} per user), {s['items']:,} items "
        "(power law, alpha "
        f"{s['alpha']:g}), d = {s['dim']}; GEMM {s['gemm_n']}x{s['gemm_n']}, best of {s['repeats']} after a warm-up, "
        "one BLAS thread; Spark "
        f"stats job ({s['shards']} shards) on the bench's local session, run {s['spark_runs']} time(s), the fastest "
        "after the first reported (the only one at --quick). "
        f"`bench.trainer_memory`: one SSP2 epoch over random statistics of {small['items']:,} and {large['items']:,} "
        f"items, d = {small['dim']}, "
        "in a child interpreter (its own peak). Timings are this machine's at the time of the run: other processes on "
        "its cores add "
        "noise, and at --quick sizes fixed costs dominate, so the targets are meant for the full sizes."
    )
    section.table(
        ["figure", "measured", "target", "verdict"],
        [
            [
                "kernel rate / GEMM rate (file order)",
                f"{stats['kernel_fraction']:.2f} ({stats['kernel_unsorted_gflops']:.2f} / {stats['gemm_gflops']:.2f} "
                "GFLOP/s)",
                f">= {stats['kernel_target']:.2f}",
                verdict(stats["kernel_fraction"] >= stats["kernel_target"]),
            ],
            [
                "Spark end-to-end / kernel time",
                f"{stats['spark_over_kernel']:.2f} ({stats['spark_end_to_end_s']:.2f} s / "
                f"{stats['kernel_unsorted_s']:.2f} s)",
                f"<= {stats['spark_target']:.1f}",
                verdict(stats["spark_over_kernel"] <= stats["spark_target"]),
            ],
            [
                f"trainer peak, {large['items']:,} items",
                f"{large['peak_rss_mib']:.0f} MiB",
                f"< {memory['limit_mib']:.0f} MiB",
                verdict(large["peak_rss_mib"] < memory["limit_mib"]),
            ],
            [
                f"trainer peak growth for {large['items'] // small['items']}x the items",
                f"{growth:.2f}x ({small['peak_rss_mib']:.0f} -> {large['peak_rss_mib']:.0f} MiB)",
                "about 1x (streams item minibatches)",
                "-",
            ],
        ],
    )
    section.figure(
        figure,
        "Stats kernel rate against GEMM (left) and the trainer's peak memory against catalog size (right), with the "
        "targets.",
    )
    return section
