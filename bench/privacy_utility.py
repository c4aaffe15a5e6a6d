"""The paper's privacy-utility figures: test metric against epsilon for every method, each tuned alike.

For every method of bench.training.METHODS (non-private top lines, the starting point, DP
popularity and the implicit-ALS reference under the ranking protocol, DP-ALS, DP-CMF, AM-DPSGD,
AM-SSP) and every epsilon, a tuning study with the same budget of trials runs on the training split and is scored on the
VALIDATION split: trial 0 is the method's defaults, the next ones Optuna's TPE over the method's
search space (continuous and log ranges; the first few seeded random draws), seeded per (method,
epsilon) (bench.training.suggest). The best configuration then runs `--seeds` times (other model
seeds, fresh noise) and is scored on TEST. The non-private top lines are tuned once; a method with
nothing to tune (implicit ALS, whose grid is its own) has one trial.

Every trial is a harness cell, so a study interrupted and restarted replays its finished trials
(the sampler, rebuilt from them, suggests again exactly what it suggested) and continues with the
first missing one: a killed run loses at most the trial in flight. `--methods` and `--epsilons`
select the studies, so the experiment can run in parts into one OUT.

Transfer mode (`--tune-on A --data B`): the studies run on A's validation split, and the chosen
settings run on B's test split; tuning then costs B no privacy. Both modes recorded in one OUT are
reported side by side (the table's mode column). Cells are shared: the long-tail and
time-to-quality experiments read the same ones. Besides the report section, OUT/results.csv and
OUT/results_table.json hold the table (mode, method, epsilon, mean, std, seeds, epsilon spent; for
the recall protocol also the test Recall@50, NDCG@100 and coverage@20 means, "-" in the report for
cells recorded before they were).
"""

from __future__ import annotations

import csv
import math
import os

import numpy as np

from bench import harness, training
from schemas import storage
from schemas.errors import UserError
from schemas.progress import bar as progress_bar
from trainer.metrics import RANKING

NAME = "privacy-utility"
OTHER_RANKING = {key: name for key, name in RANKING.items() if key != "recall_at_20"}  # columns beside Recall@20
TABLE_CSV = "results.csv"
TABLE_JSON = "results_table.json"


def sizes(quick: bool) -> dict:
    """Epsilons, trials per (method, epsilon), random startup trials of TPE, the base config every
    cell sets and caps on the search space. Full: 12 trials per study. A trial at the defaults on the
    bundled data, 2 cores, epsilon 10, measured: AM-SSP 61 s, DP-ALS 13 s, the starting point 10 s,
    DP popularity 1.4 s (recall); the sampler's larger d, epochs and outer steps take several times
    longer, so the full run takes hours: run it in parts with --methods / --epsilons. Quick: minutes."""
    if quick:
        return {
            "epsilons": [1.0, 10.0],
            "trials": 2,
            "startup": 2,
            "base": {"epochs": 10, "dpsgd_epochs": 2.0, "outer_steps": 2},
            "caps": {"dim": 16, "outer_steps": 2, "epochs": 10, "dpsgd_epochs": 2.0},
        }
    return {
        "epsilons": [1.0, 5.0, 10.0, 20.0],
        "trials": 12,
        "startup": training.STARTUP_TRIALS,
        "base": {},
        "caps": {},
    }


def size_of(ctx: harness.Context) -> dict:
    """The experiment's sizes with the epsilons --epsilons and the trials --trials select."""
    size = sizes(ctx.quick)
    if ctx.trials:
        size = {**size, "trials": ctx.trials}
    return {**size, "epsilons": sorted(ctx.epsilons)} if ctx.epsilons else size


def methods_of(ctx: harness.Context) -> list[str]:
    """The selected methods pipelines.training offers that run under the protocol."""
    return [n for n in training.select(ctx.methods) if training.available(n) and training.runs_under(n, ctx.protocol)]


def groups(names: list[str], size: dict) -> list[tuple[str, float | None]]:
    """(method, epsilon) pairs to tune: every epsilon for a private method, None for a top line."""
    return [(name, eps) for name in names for eps in (size["epsilons"] if training.METHODS[name].private else [None])]


def study(
    results: harness.Results,
    data: str,
    protocol: str,
    name: str,
    epsilon: float | None,
    *,
    size: dict,
    compute=None,
    bar=None,
    seed: int | None = None,
) -> list[dict] | None:
    """The trials of the (method, epsilon) study on `data`, in order, as {"params", "value"}: trial
    t's config is the seeded TPE suggestion given trials 0..t-1 (trial 0: the defaults; `seed`:
    the study seed, training.study_seed by default), its value the recorded cell or, when missing,
    `compute(params)` through the harness (recorded at once). Without `compute`, None as soon as a
    trial is missing (nothing is computed)."""
    metric = training.METRICS[protocol]
    seed = training.study_seed(name, epsilon) if seed is None else seed
    history, trials = [], []
    for t in range(size["trials"] if training.search_space(name, size["caps"], protocol) else 1):  # one if untuned
        draw = training.suggest(
            name,
            seed,
            history,
            size["caps"],
            metric.lower_is_better,
            size.get("startup", training.STARTUP_TRIALS),
            protocol,
        )
        params = training.cell_params(data, protocol, name, epsilon, training.cell_config(name, size["base"], draw), t)
        value = results.get(NAME, params)
        if value is None:
            if compute is None:
                return None
            (value,) = results.run(NAME, [params], compute, progress=False)
        if bar is not None:
            bar.update()
        trials.append({"params": params, "value": value})
        history.append((training.tuned_values(name, params["config"], size["caps"], epsilon, protocol), value["valid"]))
    return trials


def test_params(data: str, protocol: str, name: str, epsilon: float | None, config: dict, seeds: int) -> list[dict]:
    return [training.cell_params(data, protocol, name, epsilon, config, training.TEST_SEED + s) for s in range(seeds)]


def best_trial(values: list[dict], protocol: str) -> int:
    """Index of the best validation metric (the first among ties: the defaults win a tie); failed
    trials (no metric) are never chosen."""
    metric = training.METRICS[protocol]
    best = None
    for k, value in enumerate(values):
        score = value["valid"]
        if score is None or not math.isfinite(score):
            continue
        if best is None or metric.better(score, values[best]["valid"]):
            best = k
    if best is None:
        raise UserError("every trial of the study failed")
    return best


def tuned_config(
    results: harness.Results, data: str, protocol: str, name: str, epsilon: float | None, size: dict
) -> dict | None:
    """The configuration the study on `data` chose, if all its trials are recorded (nothing is computed)."""
    trials = study(results, data, protocol, name, epsilon, size=size)
    return None if trials is None else trials[best_trial([t["value"] for t in trials], protocol)]["params"]["config"]


def _abs(data: str) -> str:
    return os.path.abspath(data)


def mode_of(data: str, tune_on: str) -> str:
    return "direct" if _abs(data) == _abs(tune_on) else "transfer"


def gather(ctx: harness.Context, size: dict, names: list[str], data: str, tune_on: str, compute: bool) -> dict:
    """The groups {(method, epsilon): {trials, best, config, tests}} of one mode: studies on
    `tune_on`'s validation split, the chosen configs' test runs on `data`. With `compute`, missing
    cells are computed (two progress bars: trials, then test runs); without, only the groups whose
    cells are all recorded are returned."""
    pairs = groups(names, size)
    out = {}
    with progress_bar(
        total=len(pairs) * size["trials"],
        desc=f"{NAME}: tuning" + ("" if mode_of(data, tune_on) == "direct" else " (transfer)"),
        unit="trial",
        enabled=compute and ctx.progress,
    ) as bar:
        for pair in pairs:
            trials = study(
                ctx.results,
                tune_on,
                ctx.protocol,
                *pair,
                size=size,
                compute=(lambda p: training.run_trial(ctx.out, p)) if compute else None,
                bar=bar,
            )
            if trials is None:
                continue
            values = [t["value"] for t in trials]
            best = best_trial(values, ctx.protocol)
            out[pair] = {"trials": values, "best": best, "config": trials[best]["params"]["config"]}
    tests = {pair: test_params(data, ctx.protocol, *pair, group["config"], ctx.seeds) for pair, group in out.items()}
    if compute:
        flat = ctx.results.run(
            NAME,
            [p for pair in out for p in tests[pair]],
            lambda p: training.run_cell(ctx.out, p),
            ctx.progress,
            f"{NAME}: test runs" + ("" if mode_of(data, tune_on) == "direct" else " (transfer)"),
        )
        for k, pair in enumerate(out):
            out[pair]["tests"] = flat[k * ctx.seeds : (k + 1) * ctx.seeds]
        return out
    for pair in list(out):
        values = [ctx.results.get(NAME, p) for p in tests[pair]]
        if any(v is None for v in values):
            del out[pair]
        else:
            out[pair]["tests"] = values
    return out


def recorded_sources(results: harness.Results, protocol: str) -> list[str]:
    """The data sets this experiment's recorded trials tuned on (under the protocol)."""
    return sorted(
        {
            c["params"]["data"]
            for c in results.cells.values()
            if c["experiment"] == NAME
            and c["params"]["protocol"] == protocol
            and c["params"]["seed"] < training.TEST_SEED
        }
    )


def collect(ctx: harness.Context) -> dict:
    """The invoked mode's groups (computing what is not recorded: studies on --tune-on, default
    --data; test runs on --data), and, under "others", every other mode recorded in OUT for the same
    data, protocol, methods and epsilons (studies on another data set, or on --data itself)."""
    size = size_of(ctx)
    data = training.data_of(ctx.data)
    tune_on = _abs(ctx.tune_on or data)
    names = methods_of(ctx)
    main = gather(ctx, size, names, data, tune_on, compute=True)
    others = []
    for source in [
        s for s in dict.fromkeys([_abs(data), *recorded_sources(ctx.results, ctx.protocol)]) if s != tune_on
    ]:
        found = gather(ctx, size, names, data, source, compute=False)
        if found:
            others.append({"tune_on": source, "mode": mode_of(data, source), "groups": found})
    return {
        "data": data,
        "tune_on": tune_on,
        "mode": mode_of(data, tune_on),
        "protocol": ctx.protocol,
        "size": size,
        "methods": names,
        "seeds": ctx.seeds,
        "groups": main,
        "others": others,
    }


def modes(collected: dict) -> list[dict]:
    """Every mode of the collection, the invoked one first: {"tune_on", "mode", "groups"}."""
    return [
        {"tune_on": collected["tune_on"], "mode": collected["mode"], "groups": collected["groups"]}
    ] + collected.get("others", [])


def table(collected: dict) -> list[dict]:
    """One row per (mode, method, epsilon), ordered by method, epsilon, then mode (the invoked one
    first): test metric mean, std, seeds, mean epsilon spent, where the study tuned."""
    rows = []
    order = {name: k for k, name in enumerate(training.METHODS)}
    for m, mode in enumerate(modes(collected)):
        for (name, eps), group in mode["groups"].items():
            mean, std = training.mean_std([v["test"] for v in group["tests"]])
            spent = [v["epsilon_spent"] for v in group["tests"]]
            rows.append(
                {
                    "mode": mode["mode"],
                    "tuned_on": mode["tune_on"],
                    "protocol": collected["protocol"],
                    "metric": training.METRICS[collected["protocol"]].name,
                    "method": name,
                    "label": training.METHODS[name].label,
                    "epsilon": math.inf if eps is None else eps,
                    "mean": mean,
                    "std": std,
                    "n_seeds": len(group["tests"]),
                    "epsilon_spent": math.inf if None in spent else float(np.mean(spent)),
                    **(_other_metrics(group["tests"]) if collected["protocol"] == "recall" else {}),
                    "_mode": m,
                    "_group": group,
                }
            )
    rows.sort(key=lambda r: (order[r["method"]], r["epsilon"], r["_mode"]))
    return rows


def _other_metrics(tests: list[dict]) -> dict:
    """The ranking metrics beside Recall@20 (OTHER_RANKING), each the mean over the test runs; None
    where a run did not record it (cells measured before bench.training recorded them)."""
    return {
        key: float(np.mean([v["ranking"]["test"][key] for v in tests]))
        if all(key in v.get("ranking", {}).get("test", {}) for v in tests)
        else None
        for key in OTHER_RANKING
    }


def public(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def winners(rows: list[dict], protocol: str) -> list[dict]:
    """Per epsilon, the best private method by mean test metric and its margin over the runner-up
    (None when one method ran), with both stds over seeds. `rows` of one mode."""
    metric = training.METRICS[protocol]
    out = []
    for eps in sorted({r["epsilon"] for r in rows if math.isfinite(r["epsilon"])}):
        ranked = sorted(
            (r for r in rows if r["epsilon"] == eps), key=lambda r: r["mean"] if metric.lower_is_better else -r["mean"]
        )
        first, second = ranked[0], ranked[1] if len(ranked) > 1 else None
        out.append(
            {
                "epsilon": eps,
                "winner": first["method"],
                "mean": first["mean"],
                "std": first["std"],
                "runner_up": second and second["method"],
                "runner_up_mean": second and second["mean"],
                "runner_up_std": second and second["std"],
                "margin": second and abs(first["mean"] - second["mean"]),
            }
        )
    return out


def winner_text(win: dict, protocol: str) -> str:
    """One sentence per epsilon: who wins, by how much, against the stds over seeds."""
    metric, label = training.METRICS[protocol], lambda name: training.METHODS[name].label
    head = (
        f"epsilon = {win['epsilon']:g}: {label(win['winner'])} wins with test {metric.name} "
        f"{win['mean']:.4f} ± {win['std']:.4f}"
    )
    if win["runner_up"] is None:
        return head + " (the only private method run)."
    pooled = math.sqrt((win["std"] ** 2 + win["runner_up_std"] ** 2) / 2)
    noise = f"{win['margin'] / pooled:.1f} pooled stds" if pooled > 0 else "stds 0"
    return (
        head + f", {'below' if metric.lower_is_better else 'above'} the runner-up {label(win['runner_up'])} "
        f"({win['runner_up_mean']:.4f} ± {win['runner_up_std']:.4f}) by {win['margin']:.4f} ({noise})."
    )


def write_table(out: str, rows: list[dict]) -> None:
    """OUT/results.csv and OUT/results_table.json (the baselines' results table)."""
    columns = [
        "mode",
        "tuned_on",
        "protocol",
        "metric",
        "method",
        "label",
        "epsilon",
        "mean",
        "std",
        "n_seeds",
        "epsilon_spent",
        *(key for key in OTHER_RANKING if rows and key in rows[0]),
    ]
    rows = [public(r) for r in rows]
    tmp = os.path.join(out, f".{TABLE_CSV}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, os.path.join(out, TABLE_CSV))
    storage.write_json({"rows": rows}, os.path.join(out, TABLE_JSON))


def mode_label(mode: dict) -> str:
    """How a mode is named in the report: where its studies tuned."""
    return (
        "direct" if mode["mode"] == "direct" else f"transfer: tuned on {os.path.basename(mode['tune_on'].rstrip('/'))}"
    )


def plot(collected: dict, protocol: str):
    """Test metric against epsilon: private methods as mean ± std bands, top lines as horizontal
    bands; the modes other than direct dotted, their labels saying where they tuned."""
    metric = training.METRICS[protocol]
    fig, (ax,) = harness.new_figure(width=6.5)
    for mode in modes(collected):
        suffix, style = ("", "-") if mode["mode"] == "direct" else (f" [{mode_label(mode)}]", ":")
        for name in collected["methods"]:
            groups_ = [(eps, g) for (n, eps), g in mode["groups"].items() if n == name]
            if not groups_:
                continue
            if training.METHODS[name].private:
                harness.mean_std_band(
                    ax,
                    [eps for eps, _ in groups_],
                    np.array([[v["test"] for v in g["tests"]] for _, g in groups_]).T,
                    training.METHODS[name].label + suffix,
                    color=training.color(name),
                    linestyle=style,
                )
            else:
                mean, std = training.mean_std([v["test"] for v in groups_[0][1]["tests"]])
                ax.axhline(
                    mean,
                    linestyle="--" if style == "-" else ":",
                    color=training.color(name),
                    label=f"{training.METHODS[name].label}{suffix} (mean ± std)",
                )
                ax.axhspan(mean - std, mean + std, color=training.color(name), alpha=0.15)
    ax.set_xscale("log")
    ax.set_xticks(collected["size"]["epsilons"], [f"{e:g}" for e in collected["size"]["epsilons"]])
    harness.finish(
        ax,
        f"Privacy-utility, {os.path.basename(collected['data'].rstrip('/'))}, {protocol} protocol",
        f"privacy budget, user level, delta = {training.DELTA:g} (epsilon)",
        f"test {metric.name} ({metric.unit})",
    )
    return fig


@harness.experiment(
    NAME,
    "test metric vs epsilon for every method, each tuned on validation with the same budget of seeded TPE trials "
    "(--tune-on: tuned on another data set)",
)
def run(ctx: harness.Context) -> harness.Section:
    collected = collect(ctx)
    rows = table(collected)
    write_table(ctx.out, rows)
    figure = (
        harness.save_figure(plot(collected, ctx.protocol), ctx.out, f"privacy_utility_{ctx.protocol}.png")
        if rows
        else None
    )
    return report(ctx, collected, rows, figure)


def describe_setup(ctx: harness.Context, collected: dict) -> list[str]:
    """Paragraphs on the data, sizes, tuning budget and methods."""
    size, metric = collected["size"], training.METRICS[ctx.protocol]
    requested = training.select(ctx.methods)
    skipped = [n for n in requested if not training.available(n)]
    elsewhere = [n for n in requested if training.available(n) and not training.runs_under(n, ctx.protocol)]
    where = (
        f"on the VALIDATION split of `{collected['tune_on']}` (transfer mode: tuning costs `{collected['data']}` no "
        "privacy), "
        if collected["mode"] == "transfer"
        else "scored on the validation split; "
    )
    lines = [
        (
            f"**Setup.** Data `{collected['data']}`, protocol `{ctx.protocol}` (metric {metric.name}), user-level "
            "privacy, "
            f"delta = {training.DELTA:g}, epsilons {', '.join(f'{e:g}' for e in size['epsilons'])}; every run is the "
            "real pipeline "
            "(`pipelines.training.stages.run`: Spark jobs, ledger, TensorFlow trainer) with a fresh noise seed. "
            f"**Tuning budget: {size['trials']} runs per method and epsilon, the same for every method** (trial 0 the "
            "method's defaults, then "
            "Optuna's multivariate TPE over the search space below, its first "
            f"{size.get('startup', training.STARTUP_TRIALS)} trials seeded random "
            f"draws; seeded per method and epsilon{', capped at ' + str(size['caps']) if size['caps'] else ''}), "
            f"{where}the best configuration is then run with {collected['seeds']} model seeds and scored on the test "
            f"split of `{collected['data']}`. "
            f"Every cell sets {size['base'] or 'nothing beyond the method'} (those the method tunes) on top of the "
            "TrainConfig defaults."
        )
    ]
    if len(modes(collected)) > 1:
        lines.append(
            "**Modes.** "
            + "; ".join(
                f"{mode_label(m)}: studies on `{m['tune_on']}`, {len(m['groups'])} (method, epsilon) groups"
                for m in modes(collected)
            )
            + ". Both are in the table below (column mode) and in the figure (transfer dotted)."
        )
    if any(training.METHODS[n].kind == "popularity" for n in collected["methods"]):
        lines.append(
            "**DP popularity** ranks every candidate by the run's DP item count (the counts release of "
            "`train.prepare`, nothing "
            "else), scored with the same ranking-metric code as the other methods; its epsilon spent is that release's "
            "share only."
        )
    if any(training.METHODS[n].kind == "ials" for n in collected["methods"]):
        lines.append(
            "**Implicit ALS** is the non-private reference of the ranking protocol: Hu, Koren and Volinsky's implicit "
            "ALS (d = 32) "
            "on the same split, trained on the top 10% items by exact count, its (alpha, lambda) grid chosen on the "
            "validation "
            "users (one trial: nothing left to tune), held-out users folded in by its own user solve."
        )
    if skipped:
        lines.append(
            "**Not run** (pipelines.training has no such item update yet): "
            + ", ".join(
                f"{training.METHODS[n].label} (`{training.METHODS[n].overrides['item_update']}`)" for n in skipped
            )
            + "."
        )
    if elsewhere:
        lines.append(
            f"**Not run under protocol `{ctx.protocol}`**: "
            + ", ".join(
                f"{training.METHODS[n].label} (protocol {', '.join(training.METHODS[n].protocols)} only)"
                for n in elsewhere
            )
            + "."
        )
    fixed = [
        f"{training.METHODS[n].label}: {', '.join(training.untunable(n))}"
        for n in collected["methods"]
        if training.untunable(n)
    ]
    if fixed:
        lines.append("**Left at their defaults** (no TrainConfig field of that name yet): " + "; ".join(fixed) + ".")
    failed = []
    for mode in modes(collected):
        for (name, eps), group in mode["groups"].items():
            n = sum(1 for v in group["trials"] if v.get("failed"))
            if n:
                failed.append(
                    f"{training.METHODS[name].label} at {'non-private' if eps is None else f'epsilon {eps:g}'} "
                    f"({mode_label(mode)}): {n}"
                )
    if failed:
        lines.append(
            "**Failed trials** (the run raised, e.g. diverged to non-finite predictions; told to the sampler as "
            "failed, never chosen): " + "; ".join(failed) + "."
        )
    return lines


def report(ctx: harness.Context, collected: dict, rows: list[dict], figure: str | None) -> harness.Section:
    metric = training.METRICS[ctx.protocol]
    section = harness.Section(f"Privacy-utility trade-off ({ctx.protocol} protocol)")
    for paragraph in describe_setup(ctx, collected):
        section.text(paragraph)
    if not rows:
        section.text(
            "**Nothing to run:** no selected method is offered by pipelines.training and runs under this protocol."
        )
        return section
    section.table(
        ["method", "fixed settings", "search space"],
        [
            [
                training.METHODS[n].label,
                training.METHODS[n].overrides,
                training.describe_space(training.search_space(n, collected["size"]["caps"], ctx.protocol)),
            ]
            for n in collected["methods"]
        ],
    )
    section.figure(
        figure,
        f"Test {metric.name} against epsilon (mean ± std over {ctx.seeds} seeds; non-private top lines dashed"
        + ("; transfer mode dotted" if any(m["mode"] == "transfer" for m in modes(collected)) else "")
        + ").",
    )
    others = OTHER_RANKING if ctx.protocol == "recall" else {}
    section.table(
        [
            "method",
            "mode",
            "epsilon",
            f"test {metric.name} mean",
            "std",
            "seeds",
            "epsilon spent",
            *(f"test {name} mean" for name in others.values()),
            "chosen config (beyond the method's)",
            "valid of the choice",
        ],
        [
            [
                r["label"],
                mode_label({"mode": r["mode"], "tune_on": r["tuned_on"]}),
                f"{r['epsilon']:g}",
                r["mean"],
                r["std"],
                r["n_seeds"],
                f"{r['epsilon_spent']:.4g}",
                *("-" if r[key] is None else r[key] for key in others),
                {
                    k: _short(v)
                    for k, v in r["_group"]["config"].items()
                    if k not in training.METHODS[r["method"]].overrides
                },
                r["_group"]["trials"][r["_group"]["best"]]["valid"],
            ]
            for r in rows
        ],
    )
    for m, mode in enumerate(modes(collected)):
        wins = winners([r for r in rows if r["_mode"] == m], ctx.protocol)
        if wins:
            section.text(
                f"**Who wins{'' if len(modes(collected)) == 1 else ' (' + mode_label(mode) + ')'}.** "
                + " ".join(winner_text(w, ctx.protocol) for w in wins)
            )
    cells = [v for mo in modes(collected) for g in mo["groups"].values() for v in g["trials"] + g["tests"]]
    trial_seconds = [
        v["seconds"]
        for mo in modes(collected)
        for g in mo["groups"].values()
        for v in g["trials"]
        if v["seconds"] is not None
    ]
    per_trial = f"; a tuning trial took {np.mean(trial_seconds):.0f} s on average" if trial_seconds else ""
    section.text(
        f"The table is also in `{TABLE_CSV}` and `{TABLE_JSON}`. The {len(cells)} runs took "
        f"{sum(v['seconds'] or 0.0 for v in cells) / 60:.1f} minutes of training wall time in all{per_trial} "
        "(run directories are deleted once measured)."
    )
    return section


def _short(value):
    """A chosen value as the report shows it (4 significant digits)."""
    return float(f"{value:.4g}") if isinstance(value, float) else value
