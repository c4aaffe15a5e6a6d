"""The paper's privacy-utility figures: test metric against epsilon for every method, each tuned alike.

For every method of bench.training.METHODS (non-private top lines, DP-ALS, DP-CMF, AM-DPSGD, AM-SSP)
and every epsilon, a random search with the same fixed budget of trials (the method's defaults,
then seeded draws from its search space) runs on the training split and is scored on the
VALIDATION split; the best configuration then runs `--seeds` times (other model seeds, fresh noise)
and is scored on TEST. The non-private top lines are tuned once. Cells are shared: the long-tail
and time-to-quality experiments read the same ones. Besides the report section, OUT/results.csv
and OUT/results_table.json hold the table (method, epsilon, mean, std, seeds, epsilon spent).
"""

from __future__ import annotations

import csv
import math
import os

import numpy as np

from bench import harness, training
from schemas import storage

NAME = "privacy-utility"
TABLE_CSV = "results.csv"
TABLE_JSON = "results_table.json"


def sizes(quick: bool) -> dict:
    """Epsilons, trials per (method, epsilon), the base config every cell sets and caps on the
    search space. Full: about 40 minutes on the bundled data on 2 cores with the methods available
    today; quick: a few minutes."""
    if quick:
        return {"epsilons": [1.0, 10.0], "trials": 2, "base": {"epochs": 10, "dpsgd_epochs": 2.0, "outer_steps": 2},
                "caps": {"dim": 16, "outer_steps": 2, "epochs": 10, "dpsgd_epochs": 2.0}}
    return {"epsilons": [1.0, 5.0, 10.0, 20.0], "trials": 10, "base": {}, "caps": {}}


def groups(names: list[str], size: dict) -> list[tuple[str, float | None]]:
    """(method, epsilon) pairs to tune: every epsilon for a private method, None for a top line."""
    return [(name, eps) for name in names for eps in (size["epsilons"] if training.METHODS[name].private else [None])]


def trial_params(data: str, protocol: str, name: str, epsilon: float | None, size: dict) -> list[dict]:
    return [training.cell_params(data, protocol, name, epsilon, training.cell_config(name, size["base"], draw), trial)
            for trial, draw in enumerate(training.draws(name, epsilon, size["trials"], size["caps"]))]


def test_params(data: str, protocol: str, name: str, epsilon: float | None, config: dict, seeds: int) -> list[dict]:
    return [training.cell_params(data, protocol, name, epsilon, config, training.TEST_SEED + s) for s in range(seeds)]


def best_trial(values: list[dict], protocol: str) -> int:
    """Index of the best validation metric (the first among ties: the defaults win a tie)."""
    metric = training.METRICS[protocol]
    best = 0
    for k, value in enumerate(values):
        if metric.better(value["valid"], values[best]["valid"]):
            best = k
    return best


def tuned_config(results: harness.Results, data: str, protocol: str, name: str, epsilon: float | None, size: dict) -> dict | None:
    """The configuration the search chose, if all its trials are recorded (nothing is computed)."""
    params = trial_params(data, protocol, name, epsilon, size)
    values = [results.get(NAME, p) for p in params]
    if any(v is None for v in values):
        return None
    return params[best_trial(values, protocol)]["config"]


def collect(ctx: harness.Context) -> dict:
    """Every (method, epsilon) group of the context: trials, chosen config, test runs; computing
    (two progress bars: trials, then test runs) only the cells not recorded yet."""
    size = sizes(ctx.quick)
    data = training.data_of(ctx.data)
    names = [n for n in training.select(ctx.methods) if training.available(n)]
    pairs = groups(names, size)
    trials = {pair: trial_params(data, ctx.protocol, *pair, size) for pair in pairs}
    values = ctx.results.run(NAME, [p for pair in pairs for p in trials[pair]], lambda p: training.run_cell(ctx.out, p), ctx.progress, f"{NAME}: tuning")
    out, tests = {}, []
    for k, pair in enumerate(pairs):
        trial_values = values[k * size["trials"] : (k + 1) * size["trials"]]
        best = best_trial(trial_values, ctx.protocol)
        out[pair] = {"trials": trial_values, "best": best, "config": trials[pair][best]["config"]}
        tests += test_params(data, ctx.protocol, *pair, out[pair]["config"], ctx.seeds)
    test_values = ctx.results.run(NAME, tests, lambda p: training.run_cell(ctx.out, p), ctx.progress, f"{NAME}: test runs")
    for k, pair in enumerate(pairs):
        out[pair]["tests"] = test_values[k * ctx.seeds : (k + 1) * ctx.seeds]
    return {"data": data, "protocol": ctx.protocol, "size": size, "methods": names, "seeds": ctx.seeds, "groups": out}


def table(collected: dict) -> list[dict]:
    """One row per (method, epsilon): test metric mean, std, seeds, mean epsilon spent."""
    rows = []
    for (name, eps), group in collected["groups"].items():
        mean, std = training.mean_std([v["test"] for v in group["tests"]])
        spent = [v["epsilon_spent"] for v in group["tests"]]
        rows.append({"protocol": collected["protocol"], "metric": training.METRICS[collected["protocol"]].name, "method": name,
                     "label": training.METHODS[name].label, "epsilon": math.inf if eps is None else eps, "mean": mean, "std": std,
                     "n_seeds": len(group["tests"]), "epsilon_spent": math.inf if None in spent else float(np.mean(spent))})
    return rows


def winners(rows: list[dict], protocol: str) -> list[dict]:
    """Per epsilon, the best private method by mean test metric and its margin over the runner-up
    (None when one method ran), with both stds over seeds."""
    metric = training.METRICS[protocol]
    out = []
    for eps in sorted({r["epsilon"] for r in rows if math.isfinite(r["epsilon"])}):
        ranked = sorted((r for r in rows if r["epsilon"] == eps), key=lambda r: r["mean"] if metric.lower_is_better else -r["mean"])
        first, second = ranked[0], ranked[1] if len(ranked) > 1 else None
        out.append({"epsilon": eps, "winner": first["method"], "mean": first["mean"], "std": first["std"],
                    "runner_up": second and second["method"], "runner_up_mean": second and second["mean"], "runner_up_std": second and second["std"],
                    "margin": second and abs(first["mean"] - second["mean"])})
    return out


def winner_text(win: dict, protocol: str) -> str:
    """One sentence per epsilon: who wins, by how much, against the stds over seeds."""
    metric, label = training.METRICS[protocol], lambda name: training.METHODS[name].label
    head = f"epsilon = {win['epsilon']:g}: {label(win['winner'])} wins with test {metric.name} {win['mean']:.4f} ± {win['std']:.4f}"
    if win["runner_up"] is None:
        return head + " (the only private method run)."
    pooled = math.sqrt((win["std"] ** 2 + win["runner_up_std"] ** 2) / 2)
    noise = f"{win['margin'] / pooled:.1f} pooled stds" if pooled > 0 else "stds 0"
    return (head + f", {'below' if metric.lower_is_better else 'above'} the runner-up {label(win['runner_up'])} "
            f"({win['runner_up_mean']:.4f} ± {win['runner_up_std']:.4f}) by {win['margin']:.4f} ({noise}).")


def write_table(out: str, rows: list[dict]) -> None:
    """OUT/results.csv and OUT/results_table.json (the baselines' results table)."""
    columns = ["protocol", "metric", "method", "label", "epsilon", "mean", "std", "n_seeds", "epsilon_spent"]
    tmp = os.path.join(out, f".{TABLE_CSV}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, os.path.join(out, TABLE_CSV))
    storage.write_json({"rows": rows}, os.path.join(out, TABLE_JSON))


def plot(collected: dict, protocol: str):
    """Test metric against epsilon: private methods as mean ± std bands, top lines as horizontal bands."""
    metric = training.METRICS[protocol]
    fig, (ax,) = harness.new_figure(width=6.5)
    for name in collected["methods"]:
        groups_ = [(eps, g) for (n, eps), g in collected["groups"].items() if n == name]
        if training.METHODS[name].private:
            xs = [eps for eps, _ in groups_]
            harness.mean_std_band(ax, xs, np.array([[v["test"] for v in g["tests"]] for _, g in groups_]).T, training.METHODS[name].label,
                                  color=training.color(name))
        else:
            mean, std = training.mean_std([v["test"] for v in groups_[0][1]["tests"]])
            ax.axhline(mean, linestyle="--", color=training.color(name), label=f"{training.METHODS[name].label} (mean ± std)")
            ax.axhspan(mean - std, mean + std, color=training.color(name), alpha=0.15)
    ax.set_xscale("log")
    ax.set_xticks(collected["size"]["epsilons"], [f"{e:g}" for e in collected["size"]["epsilons"]])
    harness.finish(ax, f"Privacy-utility, {os.path.basename(collected['data'].rstrip('/'))}, {protocol} protocol",
                   f"privacy budget, user level, delta = {training.DELTA:g} (epsilon)", f"test {metric.name} ({metric.unit})")
    return fig


@harness.experiment(NAME, "test metric vs epsilon for every method, each tuned on validation with the same random-search budget")
def run(ctx: harness.Context) -> harness.Section:
    collected = collect(ctx)
    rows = table(collected)
    write_table(ctx.out, rows)
    figure = harness.save_figure(plot(collected, ctx.protocol), ctx.out, f"privacy_utility_{ctx.protocol}.png")
    return report(ctx, collected, rows, figure)


def describe_setup(ctx: harness.Context, collected: dict) -> list[str]:
    """Paragraphs on the data, sizes, tuning budget and methods."""
    size, metric = collected["size"], training.METRICS[ctx.protocol]
    requested = training.select(ctx.methods)
    skipped = [n for n in requested if not training.available(n)]
    lines = [(
        f"**Setup.** Data `{collected['data']}`, protocol `{ctx.protocol}` (metric {metric.name}), user-level privacy, "
        f"delta = {training.DELTA:g}, epsilons {', '.join(f'{e:g}' for e in size['epsilons'])}; every run is the real pipeline "
        "(`pipelines.train.run`: Spark jobs, ledger, TensorFlow trainer) with a fresh noise seed. "
        f"**Tuning budget: {size['trials']} runs per method and epsilon, the same for every method** (the method's defaults, then "
        f"seeded random draws, one value per field, from the space below{', capped at ' + str(size['caps']) if size['caps'] else ''}), "
        f"scored on the validation split; the best configuration is then run with {collected['seeds']} model seeds and scored on test. "
        f"Every cell sets {size['base'] or 'nothing beyond the method'} (those the method tunes) on top of the TrainConfig defaults."
    )]
    if skipped:
        lines.append("**Not run** (pipelines.train has no such item update yet): "
                     + ", ".join(f"{training.METHODS[n].label} (`{training.METHODS[n].overrides['item_update']}`)" for n in skipped) + ".")
    fixed = [f"{training.METHODS[n].label}: {', '.join(training.untunable(n))}" for n in collected["methods"] if training.untunable(n)]
    if fixed:
        lines.append("**Left at their defaults** (no TrainConfig field of that name yet): " + "; ".join(fixed) + ".")
    return lines


def report(ctx: harness.Context, collected: dict, rows: list[dict], figure: str) -> harness.Section:
    metric = training.METRICS[ctx.protocol]
    section = harness.Section(f"Privacy-utility trade-off ({ctx.protocol} protocol)")
    for paragraph in describe_setup(ctx, collected):
        section.text(paragraph)
    section.table(["method", "fixed settings", "search space"],
                  [[training.METHODS[n].label, training.METHODS[n].overrides, {k: v for k, v in training.METHODS[n].space.items() if k not in training.untunable(n)}]
                   for n in collected["methods"]])
    section.figure(figure, f"Test {metric.name} against epsilon (mean ± std over {ctx.seeds} seeds; non-private top lines dashed).")
    section.table(["method", "epsilon", f"test {metric.name} mean", "std", "seeds", "epsilon spent", "chosen config (beyond the method's)", "valid of the choice"],
                  [[r["label"], f"{r['epsilon']:g}", r["mean"], r["std"], r["n_seeds"], f"{r['epsilon_spent']:.4g}",
                    {k: v for k, v in group["config"].items() if k not in training.METHODS[r["method"]].overrides},
                    group["trials"][group["best"]]["valid"]]
                   for r, group in zip(rows, collected["groups"].values())])
    section.text("**Who wins.** " + " ".join(winner_text(w, ctx.protocol) for w in winners(rows, ctx.protocol)))
    seconds = sum(v["seconds"] for g in collected["groups"].values() for v in g["trials"] + g["tests"])
    section.text(f"The table is also in `{TABLE_CSV}` and `{TABLE_JSON}`. The {sum(len(g['trials']) + len(g['tests']) for g in collected['groups'].values())} "
                 f"runs took {seconds / 60:.1f} minutes of training wall time in all (run directories are deleted once measured).")
    return section
