"""`ssp bench scale`: AM-SSP against AM-DPSGD from 10^4 to 10^6 users and at the paper's MovieLens-10M
and MovieLens-20M (ranking) shapes, and AM-SSP alone at 10^7:
where the time goes, and the time each needs to reach the same test metric.

The paper's efficiency claim: SSP touches the private rows once per outer step (the user update and
one statistics pass) and then trains over items, while DP-SGD trains over the users' rows. Each size
is a `ssp synth --like movielens` data set (realistic popularity, activity and ratings; the catalog
grows as users^0.6) with the activity distribution rescaled to RATINGS_PER_USER ratings per user on
average at every size (this 2-core machine cannot train on MovieLens-1M's 166 per user at 10^6
users: 1.7 x 10^8 rows), so rows grow 10x with users; beside the grid, the paper's two shapes
(PAPER_SHAPES: about 143 ratings a user, each its own catalog size; MovieLens-20M ranked by Recall@20).
Both methods run the real pipeline (`pipelines.training.stages.run`: Spark jobs, ledger, TensorFlow
trainer) at epsilon EPSILON, user level, with their tuned settings (TUNED; at the MovieLens-10M
shape their defaults, which its tuning chose; at the ranking shape TUNED_RANKING_SHAPE), one model
seed per cell.

Per cell: the wall time of every phase (prepare; per outer step the user update, the statistics
release and the item update; the final user update; the evaluation) from the run's manifest
(`Run.record_seconds`), the seconds spent inside the kernels (the user solves and the statistics
kernel, summed over Spark tasks and divided by the session's parallelism; the trainer's steps), and
the test metric after every outer step against the wall time since the run started
(bench.training.trajectory). Time to quality: the target is the worse of the two methods' final test
metrics, and a method's time is its first outer step at least that good (bench.time_to_quality).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import namedtuple

import numpy as np

from bench import harness, phase_limits, phase_memory, time_to_quality, training
from bench.child import memory_kib
from pipelines.data import synth
from pipelines.data.datasets import is_dataset, open_dataset
from pipelines.training import settings, stages
from pipelines.training.run_dir import Run

NAME = "scale"
EPSILON = 5.0
USERS = (10_000, 100_000, 1_000_000)
SSP_ONLY_USERS = (
    10_000_000,
)  # AM-SSP alone (prepare and its outer step): AM-DPSGD and the ladder would take hours here
QUICK_USERS = (300, 1_000)
RATINGS_PER_USER = 20  # mean ratings per user at every size
# The paper's two shapes, both methods: (users, items, mean ratings per user, protocol), the ratings
# heavy-tailed across users as the calibrated generator draws them. MovieLens-10M (10^7 ratings,
# RMSE); MovieLens-20M as the paper ranks on it (Liang et al.'s 136,677 users and 20,108 movies,
# 2 x 10^7 ratings, Recall@20 with training on the top 10% of items by DP count).
Shape = namedtuple("Shape", "users items ratings_per_user protocol", defaults=("rmse",))
PAPER_SHAPES = (Shape(69_878, 10_677, 143), Shape(136_677, 20_108, 144, "recall"))
RACE = ("ssp", "dpsgd")  # timed against each other (time to the same test metric)
METHODS = RACE + ("item-mean", "none")  # and the private baselines each size's quality is read against
RANKING_METHODS = RACE + ("none",)  # a ranking shape's (the DP per-item mean predicts ratings)
# AM-SSP: its defaults (they won the privacy-utility search on the 6,040-user MovieLens-like set,
# bench/results/movielens-like/report.md). AM-DPSGD: the best of the same budget of trials (12) at
# epsilon 5 on this bench's own 10^5-user set (bench/results/dpsgd-tune-100k), rounded to 3 digits.
TUNED = {
    "ssp": {},
    "item-mean": {},
    "none": {},
    "dpsgd": {
        "dim": 16,
        "lambda_u": 0.570,
        "outer_steps": 2,
        "clip_u": 1.38,
        "clip_y": 1.47,
        "wbar": 1.41,
        "count_share": 0.0500,
        "max_items_per_user": 21,
        "dpsgd_learning_rate": 0.00318,
        "dpsgd_epochs": 1,
        "dpsgd_clip": 0.366,
        "dpsgd_batch_size": 256,
    },
}
# The MovieLens-20M ranking shape: the best of 12 trials of each method at epsilon 5 on a 13,668-user sample of the
# shape (bench/results/tune-ml20m; at the MovieLens-10M shape the same tuning chose the defaults for both).
TUNED_RANKING_SHAPE = {
    "ssp": {
        "dim": 16,
        "lambda_u": 0.02168,
        "outer_steps": 2,
        "ridge": 0.0333,
        "noise_ridge": 2.008,
        "residual_penalty": 0.2179,
        "anchor": 1.02,
        "clip_u": 0.2025,
        "clip_y": 2.447,
        "count_share": 0.106,
        "max_items_per_user": 45,
        "learning_rate": 0.001128,
        "epochs": 24,
        "item_gram_share": 0.3779,
    },
    "dpsgd": {
        "dim": 16,
        "lambda_u": 0.06243,
        "outer_steps": 4,
        "clip_u": 0.5563,
        "clip_y": 1.11,
        "wbar": 1.419,
        "count_share": 0.05101,
        "max_items_per_user": 29,
        "dpsgd_learning_rate": 0.001021,
        "dpsgd_epochs": 1,
        "dpsgd_clip": 4.183,
        "dpsgd_batch_size": 64,
    },
    "none": {},
}
QUICK_CONFIG = {"epochs": 2}  # --quick: a smoke run of the machinery, not a measurement
PHASES = phase_limits.PHASES
KERNELS = ("user_update", "stats", "item_update")  # the phases of an outer step, each with its kernel
GOAL = 30.0  # AM-SSP should reach the common RMSE this many times sooner at the largest size
MEMORY_GROWTH = 0.2  # the driver's peak may grow this much from the second-largest size to the largest
DRIVER_LIMIT_MIB = 4096.0


def data_path(out: str, users: int, ratings_per_user: int = RATINGS_PER_USER, items: int | None = None) -> str:
    name = f"movielens-like-{users}-k{ratings_per_user}" + (f"-m{items}" if items else "")
    return os.path.join(out, "data", name)


def data_set(out: str, users: int, ratings_per_user: int = RATINGS_PER_USER, items: int | None = None) -> str:
    """The generated data set of a size or shape (written once under OUT/data)."""
    path = data_path(out, users, ratings_per_user, items)
    if not is_dataset(path):
        synth.generate(path, like="movielens", users=users, items=items, ratings_per_user=ratings_per_user, seed=0)
    return path


def shape_of(users: int) -> Shape | None:
    """The paper shape of that many users (None: a size of the grid)."""
    return next((shape for shape in PAPER_SHAPES if shape.users == users), None)


def protocol_of(users: int) -> str:
    shape = shape_of(users)
    return "rmse" if shape is None else shape.protocol


def _size_args(users: int) -> tuple:
    shape = shape_of(users)
    return (users,) if shape is None else (users, shape.ratings_per_user, shape.items)


def size_data_path(out: str, users: int) -> str:
    return data_path(out, *_size_args(users))


def size_data(out: str, users: int) -> str:
    """The data set of a size of the grid or of a paper shape (known by its number of users)."""
    return data_set(out, *_size_args(users))


def cells(quick: bool) -> list[dict]:
    sizes = (
        [(users, METHODS) for users in QUICK_USERS]
        if quick
        else [(users, METHODS) for users in USERS] + [(users, ("ssp",)) for users in SSP_ONLY_USERS]
    )
    grid = [
        {
            "users": users,
            "ratings_per_user": RATINGS_PER_USER,
            "method": method,
            "epsilon": EPSILON,
            "config": {**training.METHODS[method].overrides, **TUNED[method], **(QUICK_CONFIG if quick else {})},
            "seed": 0,
        }
        for users, methods in sizes
        for method in methods
    ]
    shapes = [
        {
            "users": shape.users,
            "items": shape.items,
            "ratings_per_user": shape.ratings_per_user,
            "method": method,
            "epsilon": EPSILON,
            # the MovieLens-10M shape: every method at its defaults, which its tuning chose for both (the best of 12
            # trials each on a sample of the shape, bench/results/tune-ml10m); the ranking shape: its tuning's choice
            "config": {
                **training.METHODS[method].overrides,
                **(TUNED_RANKING_SHAPE[method] if shape.protocol == "recall" else {}),
            },
            "seed": 0,
            **({} if shape.protocol == "rmse" else {"protocol": shape.protocol}),  # the stored cells keep their keys
        }
        for shape in ([] if quick else PAPER_SHAPES)
        for method in (METHODS if shape.protocol == "rmse" else RANKING_METHODS)
    ]
    return grid + shapes


def is_shape(users: int) -> bool:
    return shape_of(users) is not None


def shape_name(users: int) -> str:
    return "MovieLens-10M shape" if protocol_of(users) == "rmse" else "MovieLens-20M shape (ranking)"


def ladder_cells(quick: bool) -> list[dict]:
    return [
        {"users": users, "ratings_per_user": RATINGS_PER_USER, "method": "ladder", "seed": 0}
        for users in (QUICK_USERS if quick else USERS)
    ]


def run_ladder_cell(out: str, params: dict) -> dict:
    """The non-private ladder on a size's data (bench.ladder: its own 80/10/10 split): the shrunk
    per-item mean and biased ALS MF, the lines a private model is read against."""
    from bench import ladder

    ratings = ladder.load(data_set(out, params["users"]))
    part = ladder.split_ratings(ratings, params["seed"])
    return {
        "item_mean": ladder.item_mean(ratings, part)["test"],
        "mf": ladder.mf(ratings, part, params["seed"])["test"],
    }


def phase_seconds(manifest: dict, parallelism: int) -> tuple[dict, dict]:
    """({phase: wall seconds}, {phase: kernel seconds}) of a finished run, outer steps summed; kernel
    task seconds of Spark jobs divided by the session's parallelism (their tasks run side by side)."""
    walls, kernels = dict.fromkeys(PHASES, 0.0), dict.fromkeys(KERNELS, 0.0)
    for name, seconds in manifest.get("seconds", {}).items():
        walls[name.split("/")[-1]] += seconds
    for name, seconds in manifest.get("kernel_seconds", {}).items():
        phase = name.split("/")[-1]
        if phase in kernels and name.startswith("step-"):  # the outer steps' kernels (not the final user update's)
            kernels[phase] += seconds / (parallelism if phase in ("user_update", "stats") else 1)
    return walls, kernels


def run_cell(out: str, params: dict) -> dict:
    """Train one cell on the bench's shared Spark session; its phases, kernels and trajectory."""
    data = size_data(out, params["users"])
    root = os.path.join(out, "runs", hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16])
    shutil.rmtree(root, ignore_errors=True)
    protocol = params.get("protocol", "rmse")
    config = settings.TrainConfig.create(
        data=data,
        out=root,
        protocol=protocol,
        epsilon=params["epsilon"],
        delta=training.DELTA,
        model_seed=params["seed"],
        **params["config"],
    )
    spark = training.spark()
    os.makedirs(os.path.dirname(root), exist_ok=True)
    with open(os.path.join(out, "runs", "train.log"), "a", encoding="utf-8") as log:
        print(f"== {os.path.basename(root)} {params}", file=log, flush=True)
        before = memory_kib(os.getpid())[0] / 1024
        with phase_memory.sampled() as samples:
            metrics = stages.run(config, spark=spark, progress=False, count_jobs=True)
        steps = training.trajectory(Run(root))
    recorded = Run(root).read_manifest()
    memory = {"driver_before_mib": before, "phases": {}}
    for name, peak in phase_memory.phase_peaks(samples, recorded["phase_started_at"], recorded["seconds"]).items():
        phase = memory["phases"].setdefault(name.split("/")[-1], {"driver_mib": 0.0, "all_mib": 0.0})
        for key in phase:  # the largest over the outer steps
            phase[key] = max(phase[key], peak[key])
    walls, kernels = phase_seconds(recorded, spark.sparkContext.defaultParallelism)
    jobs = dict.fromkeys(PHASES, 0)
    for name, count in recorded.get("spark_jobs", {}).items():
        jobs[name.split("/")[-1]] += int(count)
    limited = params["method"] == "ssp" and protocol == "rmse"  # bench.phase_limits models the ratings run's work
    done = phase_limits.work(Run(root), data, config.outer_steps, config.epochs) if limited else None
    manifest = open_dataset(data).manifest
    shutil.rmtree(root)
    return {
        "rows": manifest["ratings"],
        "items": manifest["items"],
        "test": metrics[f"test_{training.METRICS[protocol].key}"],
        "seconds": walls,
        "kernel_seconds": kernels,
        "spark_jobs": jobs,
        "work": done,
        "outer_steps": config.outer_steps,
        "trajectory": steps,
        "memory": memory,
    }


def outside_share(cell: dict) -> float:
    """The share of the outer steps' wall time spent outside the kernels."""
    wall = sum(cell["seconds"][phase] for phase in KERNELS)
    return 1.0 - sum(cell["kernel_seconds"].values()) / wall if wall > 0 else float("nan")


def summarize(by_size: dict[int, dict[str, dict]]) -> dict[int, dict]:
    """Per size: the target (the worse final test RMSE), each method's time to it, the ratio."""
    out = {}
    for users, methods in by_size.items():
        if not set(RACE) <= set(methods):
            continue
        methods = {name: methods[name] for name in RACE}
        lower_is_better = training.METRICS[protocol_of(users)].lower_is_better
        finals = [cell["test"] for cell in methods.values()]
        target = max(finals) if lower_is_better else min(finals)  # the worse final
        times = {
            name: time_to_quality.time_to_reach(
                [p["seconds"] for p in cell["trajectory"]],
                [p["test"] for p in cell["trajectory"]],
                target,
                lower_is_better,
            )
            for name, cell in methods.items()
        }
        ratio = times["dpsgd"] / times["ssp"] if times["dpsgd"] and times["ssp"] else None
        out[users] = {"target": target, "times": times, "ratio": ratio}
    return out


def plot_times(by_size: dict[int, dict[str, dict]]):
    fig, (ax,) = harness.new_figure(width=6.5)
    for name in RACE:
        sizes = sorted(users for users, methods in by_size.items() if name in methods)
        totals = [sum(by_size[users][name]["seconds"].values()) for users in sizes]
        ax.plot(
            sizes, totals, marker="o", color=training.color(name), label=f"{training.METHODS[name].label}: whole run"
        )
        trained = [sum(by_size[users][name]["seconds"][p] for p in KERNELS) for users in sizes]
        ax.plot(
            sizes,
            trained,
            marker="s",
            linestyle="--",
            color=training.color(name),
            label=f"{training.METHODS[name].label}: outer steps",
        )
    sizes = sorted(by_size)
    if sizes:
        first = sum(next(iter(by_size[sizes[0]].values()))["seconds"].values())
        ax.plot(
            sizes,
            [first * users / sizes[0] for users in sizes],
            color="grey",
            linestyle=":",
            label="proportional to rows (slope 1)",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    harness.finish(
        ax,
        f"Wall time against users (epsilon {EPSILON:g}, {RATINGS_PER_USER} ratings per user)",
        "users (count)",
        "wall time (s)",
    )
    return fig


def plot_curves(by_size: dict[int, dict[str, dict]]):
    sizes = sorted(by_size)
    fig, axes = harness.new_figure(ncols=max(1, len(sizes)), width=5.0)
    for ax, users in zip(axes, sizes, strict=False):  # no sizes yet: one empty axis
        for name, cell in sorted(by_size[users].items()):
            points = cell["trajectory"]
            ax.plot(
                [p["seconds"] for p in points],
                [p["test"] for p in points],
                marker="o",
                color=training.color(name),
                label=f"{training.METHODS[name].label}, steps 0..{len(points) - 1}",
            )
        ax.set_xscale("log")
        metric = training.METRICS[protocol_of(users)]
        title = f"{shape_name(users)}: {users:,} users" if is_shape(users) else f"{users:,} users"
        harness.finish(ax, title, "wall time since the run started (s)", f"test {metric.name} ({metric.unit})")
    return fig


@harness.experiment(
    NAME,
    "AM-SSP vs AM-DPSGD at 10^4..10^6 users and the paper's MovieLens-10M and -20M shapes (AM-SSP alone at 10^7): "
    "wall time per phase, kernels' share, the metric against time, time to the same metric",
)
def run(ctx: harness.Context) -> harness.Section:
    values = ctx.results.run(NAME, cells(ctx.quick), lambda p: run_cell(ctx.out, p), ctx.progress, f"{NAME}: cells")
    by_size: dict[int, dict[str, dict]] = {}
    for params, value in zip(cells(ctx.quick), values, strict=True):
        by_size.setdefault(params["users"], {})[params["method"]] = value
    ladders = dict(
        zip(
            [p["users"] for p in ladder_cells(ctx.quick)],
            ctx.results.run(
                NAME, ladder_cells(ctx.quick), lambda p: run_ladder_cell(ctx.out, p), ctx.progress, f"{NAME}: ladder"
            ),
            strict=True,
        )
    )
    summary = summarize(by_size)
    grid = {users: methods for users, methods in by_size.items() if not is_shape(users)}
    section = harness.Section("Scale: AM-SSP against AM-DPSGD from 10^4 to 10^6 users, and AM-SSP alone at 10^7")
    section.text(
        f"`ssp synth --like movielens --users N --ratings-per-user {RATINGS_PER_USER}` (the MovieLens-1M activity "
        "distribution rescaled to "
        f"{RATINGS_PER_USER} ratings per user on average, at every size: this 2-core machine cannot train on the "
        "calibrated 166 per user at "
        f"10^6 users), regression protocol, epsilon = {EPSILON:g} (user level, delta = {training.DELTA:g}), one model "
        "seed; AM-SSP with its "
        "defaults (the privacy-utility search's choice on the 6,040-user MovieLens-like set), AM-DPSGD with the best "
        "of the same "
        "budget of trials at epsilon 5 on the 100,000-user set of this bench (bench/results/dpsgd-tune-100k). At "
        f"{', '.join(f'{u:,}' for u in SSP_ONLY_USERS)} users AM-SSP runs alone: AM-DPSGD and the ladder's ALS would "
        "take hours on this machine. Every run is `pipelines.training.stages.run` on one local Spark session (2 "
        "cores). Kernel seconds: the user solves and "
        "the statistics kernel summed over Spark tasks and divided by the parallelism, and the trainer's steps; the "
        "rest of an outer step "
        "is Spark's jobs and I/O around them, reading and writing tables, and the trainer's set-up."
    )
    section.text(
        "**The paper's shapes** ("
        + "; ".join(
            f"{shape_name(u)}: `--users {u} --items {m} --ratings-per-user {k}`, protocol {p}"
            for u, m, k, p in PAPER_SHAPES
        )
        + "): both methods, no ladder, each shape its own panel in the curves and its own line in the goals below. "
        "Each method runs its tuned settings there, the best of 12 trials of each at epsilon 5 on a tenth of the "
        "shape's users: at the MovieLens-10M shape (6,988 users, bench/results/tune-ml10m) its defaults, for AM-SSP "
        "and AM-DPSGD alike; at the ranking shape (13,668 users, bench/results/tune-ml20m) the trials' choice, "
        "bench.scale.TUNED_RANKING_SHAPE."
    )
    quality = quality_rows({u: m for u, m in by_size.items() if protocol_of(u) == "rmse"}, ladders)
    section.table(
        [
            "users",
            "ladder: per-item mean (non-private)",
            "ladder: biased MF (non-private)",
            *[training.METHODS[m].label for m in QUALITY],
        ],
        quality,
    )
    section.text(quality_verdict(grid, ladders))
    rows = []
    for users in sorted(by_size):
        for name, cell in sorted(by_size[users].items()):
            walls = cell["seconds"]
            rows.append(
                [
                    f"{users:,}",
                    f"{cell['rows']:,}",
                    f"{cell['items']:,}",
                    training.METHODS[name].label,
                    *[f"{walls[p]:.0f}" for p in PHASES],
                    f"{sum(walls.values()):.0f}",
                    f"{outside_share(cell):.0%}",
                    f"{training.METRICS[protocol_of(users)].name} {cell['test']:.4f}",
                ]
            )
    section.table(
        [
            "users",
            "ratings",
            "items",
            "method",
            *[f"{p} (s)" for p in PHASES],
            "total (s)",
            "outer steps outside kernels",
            "final test metric",
        ],
        rows,
    )
    section.figure(
        harness.save_figure(plot_times(grid), ctx.out, "scale_time_vs_users.png"),
        "Wall time of a whole run and of its outer steps against the number of users (log-log).",
    )
    section.figure(
        harness.save_figure(plot_curves(by_size), ctx.out, "scale_rmse_vs_time.png"),
        "Test RMSE (Recall@20 for the ranking shape) after each outer step against the wall time since the run "
        "started, per size.",
    )
    ratios = []
    for users, result in sorted(summary.items()):
        times = result["times"]
        ratios.append(
            [
                f"{users:,}",
                f"{training.METRICS[protocol_of(users)].name} {result['target']:.4f}",
                "not reached" if times["ssp"] is None else f"{times['ssp']:.0f}",
                "not reached" if times["dpsgd"] is None else f"{times['dpsgd']:.0f}",
                "-" if result["ratio"] is None else f"{result['ratio']:.1f}x",
            ]
        )
    section.table(
        [
            "users",
            "target test metric (the worse final)",
            "AM-SSP time to it (s)",
            "AM-DPSGD time to it (s)",
            "ratio (AM-DPSGD / AM-SSP)",
        ],
        ratios,
    )
    kernels = []
    for users in sorted(by_size):
        for name, cell in sorted(by_size[users].items()):
            wall = {p: cell["seconds"][p] for p in KERNELS}
            kernels.append(
                [
                    f"{users:,}",
                    training.METHODS[name].label,
                    *[f"{cell['kernel_seconds'][p]:.1f} of {wall[p]:.0f}" for p in KERNELS],
                ]
            )
    section.table(["users", "method", *[f"{p}: kernel of wall (s)" for p in KERNELS]], kernels)
    memory = memory_rows(by_size)
    if memory:
        section.text(
            "**Peak memory by phase** (resident set in MiB, sampled every 0.25 s, as driver / all: the driver is "
            "the bench's Python process, which runs the stages and the trainer; all adds what runs under it, "
            "Spark's JVM and its Python workers; the driver's resident set before the run is its baseline)."
        )
        section.table(["users", "method", "driver before (MiB)", *[f"{p} (MiB)" for p in PHASES]], memory)
        section.text(memory_verdict(by_size))
    measured = [users for users in sorted(by_size) if (by_size[users].get("ssp") or {}).get("work")]
    if measured:
        written = [users for users in measured if is_dataset(size_data_path(ctx.out, users))]
        at = written[-1] if written else measured[0]  # the largest data set on disk (a report from stored cells)
        rates = phase_limits.machine(training.spark(), os.path.join(size_data(ctx.out, at), "interactions.parquet"))
        section.text(
            "**Each phase beside its limit (AM-SSP).** This machine, measured with the report: GEMM "
            f"{rates['gemm_flops'] / 1e9:.1f} GFLOP/s "
            f"(float64, both cores), Parquet read into Arrow {rates['read_bytes_per_s'] / 1e6:.0f} MB/s, a small Spark "
            "job through Python workers "
            f"{rates['job_seconds']:.2f} s. A phase's limit is the larger of its bytes at that read rate and its flops "
            "at that GEMM rate, plus its "
            "Spark jobs at that fixed cost (bench.phase_limits: what each phase reads, writes and computes)."
        )
        for users in measured:
            section.table(
                [
                    f"{users:,} users: phase",
                    "wall (s)",
                    "bytes read and written (MB)",
                    "GFLOP",
                    "Spark jobs",
                    "limit (s)",
                    "wall / limit",
                ],
                phase_limits.rows(by_size[users]["ssp"], rates),
            )
    growth = [
        f"{training.METHODS[name].label} rows^{slope:.2f}"
        for name in RACE
        if (slope := rows_growth(grid, name)) is not None
    ]
    if growth:
        section.text(
            "**Growth.** The outer steps' wall time against the number of ratings, a log-log fit over the sizes: "
            f"{'; '.join(growth)} "
            "(1: proportional to the rows)."
        )
    for users in [max((u for u in summary if not is_shape(u)), default=None), *(s.users for s in PAPER_SHAPES)]:
        if users is not None and (summary.get(users) or {}).get("ratio") is not None:
            verdict = "meets" if summary[users]["ratio"] >= GOAL else "misses"
            where = (
                f"the {shape_name(users)} ({users:,} users, {by_size[users]['ssp']['rows']:,} ratings)"
                if is_shape(users)
                else f"{users:,} users"
            )
            metric = training.METRICS[protocol_of(users)].name
            section.text(
                f"**Goal.** At {where} AM-SSP reaches test {metric} {summary[users]['target']:.4f} "
                f"{summary[users]['ratio']:.1f}x sooner than AM-DPSGD: this {verdict} the {GOAL:g}x goal."
            )
    return section


def memory_rows(by_size: dict[int, dict[str, dict]]) -> list[list[str]]:
    rows = []
    for users in sorted(by_size):
        for name, cell in sorted(by_size[users].items()):
            if "memory" in cell:
                phases = cell["memory"]["phases"]
                rows.append(
                    [
                        f"{users:,}",
                        training.METHODS[name].label,
                        f"{cell['memory']['driver_before_mib']:.0f}",
                        *[
                            f"{phases[p]['driver_mib']:.0f} / {phases[p]['all_mib']:.0f}" if p in phases else "-"
                            for p in PHASES
                        ],
                    ]
                )
    return rows


def driver_peak(cell: dict) -> float:
    """The driver's peak over the run's phases, less its resident set before the run (what the bench's
    earlier cells left in the process): what the run itself needs."""
    peak = max((phase["driver_mib"] for phase in cell["memory"]["phases"].values()), default=0.0)
    return peak - cell["memory"]["driver_before_mib"]


def memory_verdict(by_size: dict[int, dict[str, dict]]) -> str:
    """The driver's peak (AM-SSP) at the two largest sizes of the grid that have one: flat within
    MEMORY_GROWTH and under DRIVER_LIMIT_MIB?"""
    sizes = sorted(u for u in by_size if not is_shape(u) and "memory" in by_size[u].get("ssp", {}))
    if len(sizes) < 2:
        return "**Memory.** The driver's growth needs two sizes with AM-SSP's memory measured."
    small, large = (driver_peak(by_size[u]["ssp"]) for u in sizes[-2:])
    growth = large / small - 1
    flat = growth <= MEMORY_GROWTH and large < DRIVER_LIMIT_MIB
    return (
        f"**Memory.** AM-SSP's driver peaks {small:,.0f} MiB above its baseline at {sizes[-2]:,} users and "
        f"{large:,.0f} MiB at "
        f"{sizes[-1]:,} ({growth:+.0%}): {'within' if flat else 'outside'} the goal of at most "
        f"{MEMORY_GROWTH:.0%} growth and under {DRIVER_LIMIT_MIB / 1024:g} GiB."
    )


QUALITY = ("item-mean", "none", "ssp", "dpsgd")  # the private columns of the quality table, at EPSILON


def quality_rows(by_size: dict[int, dict[str, dict]], ladders: dict[int, dict]) -> list[list[str]]:
    """Per size: the ladder's lines and each private method's final test RMSE."""

    def cell(value):
        return "-" if value is None else f"{value:.4f}"

    return [
        [
            f"{users:,}",
            cell(ladders.get(users, {}).get("item_mean")),
            cell(ladders.get(users, {}).get("mf")),
            *[cell(by_size[users][m]["test"] if m in by_size[users] else None) for m in QUALITY],
        ]
        for users in sorted(by_size)
    ]


def quality_verdict(by_size: dict[int, dict[str, dict]], ladders: dict[int, dict]) -> str:
    """Whether AM-SSP improves with the data (its RMSE from the smallest size to the largest) and
    where it stands against the non-private per-item mean and MF at the largest size."""
    sizes = sorted(users for users in by_size if "ssp" in by_size[users])
    if not sizes:
        return "**Quality.** No AM-SSP cell yet."
    first, last = by_size[sizes[0]]["ssp"]["test"], by_size[sizes[-1]]["ssp"]["test"]
    trend = "falls" if last < first else "does not fall"
    text = (
        f"**Quality.** AM-SSP's test RMSE {trend} as the users grow: {first:.4f} at {sizes[0]:,} users, "
        f"{last:.4f} at {sizes[-1]:,}."
    )
    ladder = ladders.get(sizes[-1])
    if ladder:
        text += (
            f" At {sizes[-1]:,} users it is {last - ladder['item_mean']:+.4f} from the non-private per-item mean and "
            f"{last - ladder['mf']:+.4f} from biased MF."
        )
    return text


def rows_growth(by_size: dict[int, dict[str, dict]], name: str) -> float | None:
    """The log-log slope of a method's outer-step time against rows (1: proportional)."""
    sizes = sorted(users for users in by_size if name in by_size[users])
    if len(sizes) < 2:
        return None
    rows = [by_size[u][name]["rows"] for u in sizes]
    times = [sum(by_size[u][name]["seconds"][p] for p in KERNELS) for u in sizes]
    return float(np.polyfit(np.log(rows), np.log(times), 1)[0])
