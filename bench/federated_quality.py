"""`ssp bench federated`: what each client sends, and how many rounds it takes part in, to reach a
given test RMSE: federated SSP2 against federated DP-SGD (the paper's appendix argument, measured).

Data: `ssp synth --like movielens --users USERS` (the realistic generator: MovieLens-1M's activity,
popularity and ratings; the catalog grows as users^0.6), regression protocol, epsilon EPSILON.

Federated SSP2 is `ssp train --engine federated` with AM-SSP's defaults: every outer step is one
secure-aggregation round of every client (pipelines.engines.federated), and each client uploads its public
key, Shamir shares and a masked vector of the statistics catalog's A_j, b_j (8 bytes per entry) and
downloads the item embeddings. Federated DP-SGD is AM-DPSGD with the privacy-utility search's
settings at epsilon 5 (bench.scale's TUNED), run centrally: with per-user clipping, one secure-
aggregation round per DP-SGD step and the same distributed noise, the federated algorithm computes
the same update (up to the fixed point), so its curve is the central run's and its traffic is
counted: per DP-SGD step, the Poisson-sampled clients (probability q) download the encoder's
parameters and upload a masked clipped gradient of them, 8 bytes per parameter, plus the same
secure-aggregation overhead over a cohort of the expected batch; per outer step every client
downloads the item embeddings to solve its own embedding. Both methods also need the DP counts and
the DP mean (central in this simulation; two rounds each in a federated deployment): both curves
start at round 2 with those uploads counted equally (a count vector over the catalog and two sums).

Test RMSE after each outer step is measured by the trusted evaluator (bench.training.trajectory);
for the federated run it first solves the training users against each step's item embeddings
(those embeddings stay on the devices in the run). Target: the worse of the two final test RMSEs;
each method's rounds and upload to it are those of its first outer step at least that good.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

from bench import harness, scale, time_to_quality, training
from pipelines.data.datasets import open_dataset
from pipelines.engines import user_solves
from pipelines.engines.federated import SHAMIR_SHARE_BYTES
from pipelines.training import settings, stages
from pipelines.training.run_dir import Run
from privacy import secure_aggregation

NAME = "federated"
EPSILON = 5.0
USERS, QUICK_USERS = (2000, 6040), (300,)
METHODS = {"ssp": {"engine": "federated"}, "dpsgd": {**training.METHODS["dpsgd"].overrides, **scale.TUNED["dpsgd"]}}
LABELS = {"ssp": "federated SSP2 (AM-SSP)", "dpsgd": "federated DP-SGD (AM-DPSGD)"}
PREPARE_ROUNDS = 2  # the DP counts and the DP mean


def cells(quick: bool) -> list[dict]:
    return [
        {
            "users": users,
            "method": method,
            "epsilon": EPSILON,
            "config": {**config, **(scale.QUICK_CONFIG if quick else {})},
            "seed": 0,
        }
        for users in (QUICK_USERS if quick else USERS)
        for method, config in METHODS.items()
    ]


def secagg_overhead(cohort: int) -> int:
    """Bytes a client sends besides its vector in one secure-aggregation round of `cohort` clients."""
    return 32 + 3 * secure_aggregation.neighbour_count(max(cohort, 3)) * SHAMIR_SHARE_BYTES


def encoder_parameters(run: Run, step: int) -> int:
    """Trainable parameters of the item encoder DP-SGD trains (what a client's gradient holds)."""
    import tensorflow as tf

    shapes = tf.train.load_checkpoint(os.path.join(run.checkpoint(step), "ckpt")).get_variable_to_shape_map()
    return int(
        sum(
            np.prod(shape)
            for name, shape in shapes.items()
            if name.startswith("model/")
            and name.endswith("/.ATTRIBUTES/VARIABLE_VALUE")
            and "OPTIMIZER_SLOT" not in name
        )
    )


def traffic(run: Run, config: settings.TrainConfig, method: str, items: int) -> list[dict]:
    """Per outer step s = 1..S: the rounds a client takes part in (expected, for DP-SGD's sampled
    steps: all rounds, q of them with an upload) and its upload and download bytes."""
    manifest = run.read_manifest()
    units = manifest["prepared"]["units"]
    broadcast = 4 * items * config.dim  # the item embeddings, float32
    steps = []
    for s in range(1, config.outer_steps + 1):
        if method == "ssp":
            summary = json.load(open(os.path.join(run.root, f"step-{s}", "stats", "release.json")))["federated"]
            steps.append(
                {
                    "rounds": 1,
                    "upload": summary["upload_bytes_per_client"],
                    "download": broadcast + 32 * summary["neighbours"],
                }
            )
        else:
            q, dpsgd_steps = config.dpsgd_schedule(units)
            params = encoder_parameters(run, s)
            steps.append(
                {
                    "rounds": dpsgd_steps,
                    "upload": q * dpsgd_steps * (8 * params + secagg_overhead(round(q * units))),
                    "download": broadcast + q * dpsgd_steps * 4 * params,
                    "parameters": params,
                    "sampling": q,
                }
            )
    return steps


def run_cell(out: str, params: dict) -> dict:
    data = training.movielens_like(out, params["users"])
    root = os.path.join(
        out, "runs", params["method"], hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    )
    shutil.rmtree(root, ignore_errors=True)  # a rerun of a cell is a new run on the same folder, with a fresh account
    with training.own_budget_accounts(root) as account:
        config = settings.TrainConfig.create(
            data=data,
            out=root,
            protocol="rmse",
            epsilon=params["epsilon"],
            delta=training.DELTA,
            model_seed=params["seed"],
            budget_account=account,
            **params["config"],
        )
        spark = training.spark()
        os.makedirs(os.path.dirname(root), exist_ok=True)
        metrics = stages.run(config, spark=spark, progress=False)
    layout = Run(root)
    if config.engine == "federated":  # the evaluator's solves (the run's clients kept theirs)
        for s in range(1, config.outer_steps + 1):
            user_solves.run(
                spark,
                layout.centred,
                layout.item_embeddings(s - 1),
                layout.user_embeddings(s),
                config.lambda_u,
                dim=config.dim,
                gravity=config.gravity,
            )
    steps = training.trajectory(layout)
    manifest = open_dataset(data).manifest
    prepare_upload = (
        8 * manifest["items"] + 16
    )  # a count vector over the catalog and the mean's two sums, as ring elements
    value = {
        "rows": manifest["ratings"],
        "items": manifest["items"],
        "test": metrics["test_rmse"],
        "mean_predictor": metrics["test_mean_predictor_rmse"],
        "trajectory": steps,
        "traffic": traffic(layout, config, params["method"], manifest["items"]),
        "prepare_upload": prepare_upload,
    }
    shutil.rmtree(root)
    return value


def cumulative(cell: dict) -> tuple[list[float], list[float], list[float]]:
    """(rounds, upload MB, test RMSE) after the prepare stage and each outer step."""
    rounds, upload = [PREPARE_ROUNDS], [cell["prepare_upload"] / 1e6]
    for step in cell["traffic"]:
        rounds.append(rounds[-1] + step["rounds"])
        upload.append(upload[-1] + step["upload"] / 1e6)
    return rounds, upload, [p["test"] for p in cell["trajectory"]]


def summarize(by_method: dict[str, dict]) -> dict:
    target = max(cell["test"] for cell in by_method.values())
    out = {"target": target}
    for name, cell in by_method.items():
        rounds, upload, rmse = cumulative(cell)
        out[name] = {
            "rounds": time_to_quality.time_to_reach(rounds, rmse, target, True),
            "upload_mb": time_to_quality.time_to_reach(upload, rmse, target, True),
        }
    return out


def plot(by_size: dict[int, dict[str, dict]]):
    from matplotlib.ticker import NullFormatter

    fig, axes = harness.new_figure(ncols=2, width=5.5)
    styles = ["-", "--", ":"]
    for style, users in zip(styles, sorted(by_size), strict=False):  # one line style per size, at most three
        for name, cell in sorted(by_size[users].items()):
            rounds, upload, rmse = cumulative(cell)
            label = f"{LABELS[name]}, {users:,} users"
            axes[0].plot(rounds, rmse, marker="o", linestyle=style, color=training.color(name), label=label)
            axes[1].plot(upload, rmse, marker="o", linestyle=style, color=training.color(name), label=label)
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    harness.finish(
        axes[0],
        "Test RMSE against communication rounds",
        "rounds a client takes part in (cumulative)",
        "test RMSE (stars)",
    )
    harness.finish(axes[1], "Test RMSE against bytes sent", "upload per client (MB, cumulative)", "test RMSE (stars)")
    return fig


@harness.experiment(
    NAME,
    "federated SSP2 vs federated DP-SGD: rounds and bytes per client to the same test RMSE (realistic generated data)",
)
def run(ctx: harness.Context) -> harness.Section:
    values = ctx.results.run(NAME, cells(ctx.quick), lambda p: run_cell(ctx.out, p), ctx.progress, f"{NAME}: cells")
    by_size: dict[int, dict[str, dict]] = {}
    for params, value in zip(cells(ctx.quick), values, strict=True):
        by_size.setdefault(params["users"], {})[params["method"]] = value
    section = harness.Section("Federated: SSP2 against DP-SGD, rounds and bytes per client")
    sizes = "; ".join(
        f"{users:,} users: {next(iter(m.values()))['rows']:,} ratings, {next(iter(m.values()))['items']:,} items"
        for users, m in sorted(by_size.items())
    )
    section.text(
        f"`ssp synth --like movielens --users N` ({sizes}), regression protocol, epsilon {EPSILON:g} (user level, "
        f"delta {training.DELTA:g}), one "
        "seed. Federated SSP2: `ssp train --engine federated` (secure aggregation with Skellam shares, "
        "pipelines.engines.federated), AM-SSP's "
        "defaults. Federated DP-SGD: AM-DPSGD with its tuned settings, its traffic counted for one secure-aggregation "
        "round per DP-SGD step "
        "(see bench/federated_quality.py). Bytes: uploads as 8-byte ring elements, downloads as float32; both include "
        "the DP counts' and DP mean's rounds."
    )
    rows, reach = [], []
    for users, by_method in sorted(by_size.items()):
        for name, cell in sorted(by_method.items()):
            rounds, upload, rmse = cumulative(cell)
            download = sum(step["download"] for step in cell["traffic"]) / 1e6
            rows.append(
                [
                    f"{users:,}",
                    LABELS[name],
                    str(len(cell["traffic"])),
                    f"{rounds[-1]:,}",
                    f"{upload[-1]:.3g}",
                    f"{download:.3g}",
                    f"{cell['traffic'][0].get('parameters', '-')}",
                    " / ".join(f"{v:.4f}" for v in rmse),
                    f"{cell['mean_predictor']:.4f}",
                ]
            )
        if set(by_method) != set(METHODS):
            continue
        summary = summarize(by_method)
        got = {name: summary[name] for name in METHODS}
        reach.append(
            [
                f"{users:,}",
                f"{summary['target']:.4f}",
                *["not reached" if got[name]["rounds"] is None else f"{got[name]['rounds']:,.0f}" for name in METHODS],
                *[
                    "not reached" if got[name]["upload_mb"] is None else f"{got[name]['upload_mb']:.3g}"
                    for name in METHODS
                ],
            ]
        )
    section.table(
        [
            "users",
            "method",
            "outer steps",
            "rounds per client",
            "upload per client (MB)",
            "download per client (MB)",
            "encoder parameters (DP-SGD's gradient)",
            "test RMSE after prepare, each step",
            "DP mean's test RMSE",
        ],
        rows,
    )
    section.table(
        [
            "users",
            "target test RMSE (the worse final)",
            *[f"{LABELS[n]}: rounds to it" for n in METHODS],
            *[f"{LABELS[n]}: upload to it (MB)" for n in METHODS],
        ],
        reach,
    )
    section.figure(
        harness.save_figure(plot(by_size), ctx.out, "federated_rounds_bytes.png"),
        "Test RMSE after the prepare stage and each outer step against the rounds a client takes part in and the bytes "
        "it sends.",
    )
    for users, by_method in sorted(by_size.items()):
        if set(by_method) != set(METHODS):
            continue
        summary = summarize(by_method)
        ssp, dpsgd = summary["ssp"], summary["dpsgd"]
        if ssp["rounds"] and dpsgd["rounds"]:
            section.text(
                f"**{users:,} users.** To test RMSE {summary['target']:.4f}, federated SSP2 needs {ssp['rounds']:.0f} "
                "rounds against "
                f"{dpsgd['rounds']:,.0f} ({dpsgd['rounds'] / ssp['rounds']:.0f}x fewer) and sends "
                f"{ssp['upload_mb']:.3g} MB per client "
                f"against {dpsgd['upload_mb']:.3g} MB."
            )
    return section
