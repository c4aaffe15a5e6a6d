"""`ssp bench convex`: SSP-convex (the paper's Algorithm "SSP-convex", left untested there) on the
ranking protocol, against AM-SSP with the square loss and DP-SGD with the same logistic loss.

Data: `ssp synth --like movielens --users USERS` (the realistic generator), ranking protocol
(Recall@20 of held-out users), epsilon 1, 5 and 20 (user level), one seed, every method at its
defaults (no tuning for the new loss):

- AM-SSP, square loss: `ssp train --protocol recall` (implicit positives against every item through
  the users' DP Gram matrix, the paper's method as this product ships it);
- SSP-convex, logistic loss: `--loss logistic`: each outer step releases the logistic loss's
  H_j, g_j around the step's starting item embeddings (positives, and every item as a negative),
  and the SSP2 trainer descends the quadratic approximation; users solved with the same loss;
- DP-SGD, logistic loss: `--loss logistic --item-update dpsgd`: AM-DPSGD whose per-user example is
  the user's positives and as many sampled negatives, weighted to estimate the same every-item term;
- the DP popularity ranker (bench.training's): every candidate ranked by its DP count, the simplest
  honest baseline of the ranking protocol.

Test Recall@20 overall and by item popularity fifth (least to most popular); the non-private
top line of each loss is measured too (epsilon infinite).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil

from bench import harness, training
from pipelines.training import settings, stages

NAME = "convex"
USERS, QUICK_USERS = 6040, 300
EPSILONS, QUICK_EPSILONS = (1.0, 5.0, 20.0), (5.0,)
METHODS = {
    "ssp-square": ("AM-SSP, square loss", {"item_update": "ssp"}),
    "ssp-logistic": ("SSP-convex, logistic loss", {"item_update": "ssp", "loss": "logistic"}),
    "dpsgd-logistic": ("DP-SGD, logistic loss", {"item_update": "dpsgd", "loss": "logistic"}),
    "dp-popularity": ("DP popularity (baseline)", dict(training.METHODS["dp-popularity"].overrides)),
}
COLORS = {"ssp-square": "C1", "ssp-logistic": "C2", "dpsgd-logistic": "C0", "dp-popularity": "C7"}
NON_PRIVATE = ("ssp-square", "ssp-logistic")  # each loss's non-private top line


def cells(quick: bool) -> list[dict]:
    epsilons = [*(QUICK_EPSILONS if quick else EPSILONS), None]  # None: non-private
    return [
        {
            "users": QUICK_USERS if quick else USERS,
            "method": name,
            "epsilon": epsilon,
            "config": {**METHODS[name][1], **({"epochs": 2} if quick else {})},
            "seed": 0,
        }
        for epsilon in epsilons
        for name in (METHODS if epsilon is not None else NON_PRIVATE)
    ]


def run_cell(out: str, params: dict) -> dict:
    data = training.movielens_like(out, params["users"])
    if params["method"] == "dp-popularity":  # every held-out user's candidates ranked by DP count
        return training.popularity_cell(
            out,
            training.cell_params(
                data, "recall", "dp-popularity", params["epsilon"], METHODS["dp-popularity"][1], params["seed"]
            ),
        )
    root = os.path.join(out, "runs", hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16])
    shutil.rmtree(root, ignore_errors=True)  # a rerun of a cell is a new run on the same folder, with a fresh account
    privacy = {"non_private": True} if params["epsilon"] is None else {"epsilon": params["epsilon"]}
    with training.own_budget_accounts(root) as account:
        config = settings.TrainConfig.create(
            data=data,
            out=root,
            protocol="recall",
            delta=training.DELTA,
            model_seed=params["seed"],
            budget_account=account,
            **privacy,
            **params["config"],
        )
        os.makedirs(os.path.dirname(root), exist_ok=True)
        metrics = stages.run(config, spark=training.spark(), progress=False)
    shutil.rmtree(root)
    return {
        "valid": metrics["valid_recall_at_20"],
        "test": metrics["test_recall_at_20"],
        "test_sliced": metrics["test_recall_at_20_sliced"],
        "epsilon_spent": metrics["epsilon_spent"] if math.isfinite(metrics["epsilon_spent"]) else None,
        "seconds": metrics["seconds"],
    }


def plot(by_method: dict[str, dict]):
    fig, (ax,) = harness.new_figure(width=6.0)
    for name, by_epsilon in by_method.items():
        epsilons = sorted(e for e in by_epsilon if e is not None)
        ax.plot(
            epsilons, [by_epsilon[e]["test"] for e in epsilons], marker="o", color=COLORS[name], label=METHODS[name][0]
        )
        if None in by_epsilon:
            ax.axhline(
                by_epsilon[None]["test"], color=COLORS[name], linestyle=":", label=f"{METHODS[name][0]}, non-private"
            )
    ax.set_xscale("log")
    harness.finish(
        ax, "Ranking: test Recall@20 against epsilon", "epsilon (user level, log scale)", "test Recall@20 (fraction)"
    )
    return fig


@harness.experiment(
    NAME,
    "SSP-convex (logistic loss) vs AM-SSP (square) vs DP-SGD (logistic) on the ranking protocol at epsilon 1, 5, 20",
)
def run(ctx: harness.Context) -> harness.Section:
    params = cells(ctx.quick)
    values = ctx.results.run(NAME, params, lambda p: run_cell(ctx.out, p), ctx.progress, f"{NAME}: cells")
    by_method: dict[str, dict] = {}
    for p, value in zip(params, values, strict=True):
        by_method.setdefault(p["method"], {})[p["epsilon"]] = value
    users = params[0]["users"]
    section = harness.Section("SSP-convex: the logistic loss on the ranking protocol")
    section.text(
        f"`ssp synth --like movielens --users {users:,}`, `--protocol recall` (Recall@20 of held-out users), user "
        "level, delta "
        f"{training.DELTA:g}, one seed, every method at its defaults (bench/convex.py says what each runs)."
    )
    epsilons = sorted({p["epsilon"] for p in params if p["epsilon"] is not None})
    rows = []
    for name, by_epsilon in by_method.items():
        cells_ = [by_epsilon.get(e) for e in epsilons]
        top = by_epsilon.get(None)
        rows.append(
            [
                METHODS[name][0],
                *["-" if c is None else f"{c['test']:.4f}" for c in cells_],
                "-" if top is None else f"{top['test']:.4f}",
            ]
        )
    section.table(["method", *[f"epsilon {e:g}" for e in epsilons], "non-private"], rows)
    sliced = []
    for name, by_epsilon in by_method.items():
        for e in epsilons:
            if e in by_epsilon:
                sliced.append(
                    [
                        METHODS[name][0],
                        f"{e:g}",
                        *["-" if v is None else f"{v:.4f}" for v in by_epsilon[e]["test_sliced"]],
                    ]
                )
    section.table(["method", "epsilon", *[f"fifth {k + 1}" for k in range(5)]], sliced)
    section.figure(
        harness.save_figure(plot(by_method), ctx.out, "convex_recall_vs_epsilon.png"),
        "Test Recall@20 against epsilon; dotted: each loss's non-private top line.",
    )
    return section
