"""Privacy-utility: tuning choice, winners by hand, the table files, the report and plot from hand-made cells."""

import csv
import dataclasses
import json
import math

import matplotlib.pyplot as plt
import pytest

from bench import harness, privacy_utility, training
from tests.bench.handmade import DATA, SIZE, fill_privacy_utility, forbid_training, value


def row(method, eps, mean, std):
    return {"method": method, "epsilon": eps, "mean": mean, "std": std}


def test_winners_by_hand_lower_and_higher_is_better():
    rows = [
        row("nonprivate-ssp", math.inf, 0.80, 0.0),
        row("als", 1.0, 0.95, 0.02),
        row("ssp", 1.0, 0.90, 0.01),
        row("cmf", 1.0, 0.97, 0.0),
        row("als", 5.0, 0.88, 0.01),
    ]
    first, second = privacy_utility.winners(rows, "rmse")
    assert (first["epsilon"], first["winner"], first["runner_up"]) == (1.0, "ssp", "als")  # the top line never "wins"
    assert first["margin"] == pytest.approx(0.05)
    # pooled std sqrt((0.01^2 + 0.02^2) / 2) = 0.01581: 0.05 / 0.01581 = 3.16
    assert privacy_utility.winner_text(first, "rmse") == (
        "epsilon = 1: AM-SSP wins with test RMSE 0.9000 ± 0.0100, below the runner-up DP-ALS (0.9500 ± 0.0200) by "
        "0.0500 (3.2 pooled stds)."
    )
    assert (second["winner"], second["runner_up"], second["margin"]) == ("als", None, None)
    assert privacy_utility.winner_text(second, "rmse").endswith("(the only private method run).")
    # Recall@20: higher wins
    (recall,) = privacy_utility.winners([row("als", 1.0, 0.20, 0.01), row("ssp", 1.0, 0.25, 0.01)], "recall")
    assert (recall["winner"], recall["margin"]) == ("ssp", pytest.approx(0.05))
    assert "above the runner-up DP-ALS" in privacy_utility.winner_text(recall, "recall")


def test_best_trial_by_validation_first_among_ties():
    assert privacy_utility.best_trial([{"valid": 1.0}, {"valid": 0.9}, {"valid": 0.9}], "rmse") == 1
    assert privacy_utility.best_trial([{"valid": 0.1}, {"valid": 0.3}, {"valid": 0.2}], "recall") == 1
    assert privacy_utility.best_trial([{"valid": 0.5}, {"valid": 0.5}], "rmse") == 0


def test_every_method_gets_the_same_trial_budget(tmp_path):
    results = harness.Results(str(tmp_path))
    counted = {}
    tunable = [name for name in training.METHODS if training.search_space(name, SIZE["caps"])]
    for name, eps in privacy_utility.groups(list(training.METHODS), SIZE):
        trials = privacy_utility.study(
            results,
            DATA,
            training.METHODS[name].protocols[0],
            name,
            eps,
            size=SIZE,
            compute=lambda p: counted.setdefault((p["method"], p["epsilon"]), []).append(p) or value(1.0),
        )
        assert [t["params"]["seed"] for t in trials] == list(
            range(SIZE["trials"] if name in tunable else 1)
        )  # nothing to tune: one trial
        assert trials[0]["params"]["config"] == training.cell_config(name, SIZE["base"], {})  # trial 0: the defaults
    assert {len(v) for (name, _), v in counted.items() if name in tunable} == {SIZE["trials"]}
    assert len(counted) == len(privacy_utility.groups(list(training.METHODS), SIZE)) and set(training.METHODS) - set(
        tunable
    ) == {"ials", "ease"}
    # top lines once, private methods at every epsilon
    assert privacy_utility.groups(["nonprivate-als", "als"], SIZE) == [
        ("nonprivate-als", None),
        ("als", 1.0),
        ("als", 10.0),
    ]


def test_report_table_and_plot_from_handmade_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIZE)
    forbid_training(monkeypatch)
    out = str(tmp_path)
    tests = {
        ("nonprivate-als", None): [value(0.80, spent=None), value(0.82, spent=None)],
        ("als", 1.0): [1.10, 1.20],
        ("als", 10.0): [0.95, 0.97],
        ("ssp", 1.0): [1.00, 1.02],
        ("ssp", 10.0): [0.97, 0.97],
    }
    chosen = fill_privacy_utility(out, "rmse", tests, valids={("ssp", 1.0): [0.5, 0.7]})
    assert chosen[("ssp", 1.0)] == training.cell_config(
        "ssp", SIZE["base"], {}
    )  # the defaults (trial 0) validated best
    results = harness.Results(out)
    assert privacy_utility.tuned_config(results, DATA, "rmse", "ssp", 1.0, SIZE) == chosen[("ssp", 1.0)]
    assert privacy_utility.tuned_config(results, DATA, "rmse", "ssp", 5.0, SIZE) is None

    harness.run_experiment(
        "privacy-utility", out, seeds=2, progress=False, data=DATA, methods=["nonprivate-als", "als", "ssp"]
    )
    with open(tmp_path / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["method"], r["epsilon"], r["n_seeds"], r["epsilon_spent"]) for r in table] == [
        ("nonprivate-als", "inf", "2", "inf"),
        ("als", "1.0", "2", "1.0"),
        ("als", "10.0", "2", "10.0"),
        ("ssp", "1.0", "2", "1.0"),
        ("ssp", "10.0", "2", "10.0"),
    ]
    assert float(table[1]["mean"]) == pytest.approx(1.15) and float(table[1]["std"]) == pytest.approx(0.0707107)
    assert json.loads((tmp_path / "results_table.json").read_text())["rows"][3]["mean"] == pytest.approx(1.01)

    report = (tmp_path / "report.md").read_text()
    assert "**Tuning budget: 2 runs per method and epsilon, the same for every method**" in report
    assert (
        "epsilon = 1: AM-SSP wins with test RMSE 1.0100 ± 0.0141, below the runner-up DP-ALS (1.1500 ± 0.0707) by "
        "0.1400" in report
    )
    assert (
        "epsilon = 10: DP-ALS wins with test RMSE 0.9600 ± 0.0141, below the runner-up AM-SSP (0.9700 ± 0.0000) by "
        "0.0100 (1.0 pooled stds)." in report
    )
    assert "(privacy_utility_rmse.png)" in report and plt.imread(str(tmp_path / "privacy_utility_rmse.png")).ndim == 3

    collected = privacy_utility.collect(
        harness.Context(out, False, 2, results, False, DATA, "rmse", ["nonprivate-als", "als", "ssp"])
    )
    fig = privacy_utility.plot(collected, "rmse")
    (ax,) = fig.axes
    assert (
        ax.get_xlabel() == "privacy budget, user level, delta = 1e-05 (epsilon)"
        and ax.get_ylabel() == "test RMSE (rating stars)"
    )
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "non-private ALS (id) (mean ± std)",
        "DP-ALS (mean ± std, 2 seeds)",
        "AM-SSP (mean ± std, 2 seeds)",
    ]
    plt.close(fig)


def test_methods_pipelines_train_lacks_are_named_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIZE)
    monkeypatch.setitem(
        training.METHODS, "future", training.Method("Future", {"item_update": "future", "encoder": "id"}, {"dim": [8]})
    )
    forbid_training(monkeypatch)
    fill_privacy_utility(str(tmp_path), "recall", {("als", 1.0): [0.1], ("als", 10.0): [0.2]})
    harness.run_experiment(
        "privacy-utility",
        str(tmp_path),
        seeds=1,
        progress=False,
        data=DATA,
        protocol="recall",
        methods=["als", "future"],
    )
    report = (tmp_path / "report.md").read_text()
    assert "**Not run** (pipelines.training has no such item update yet): Future (`future`)." in report
    assert "epsilon = 10: DP-ALS wins with test Recall@20 0.2000 ± 0.0000 (the only private method run)." in report


SIX = {"epsilons": [1.0], "trials": 6, "startup": 2, "base": {}, "caps": {}}
A = "/data/synth-a"


class Killed(BaseException):
    """The process dies mid-trial (not an error a trial could record)."""


def fake_training(monkeypatch, calls: list, kill_at: int | None = None):
    """training.run_cell replaced by a fake objective of (data, config): the same code path (studies,
    harness cells, run_trial) without training; killed when `kill_at` cells have been computed."""

    def run(out, params):
        if kill_at is not None and len(calls) == kill_at:
            raise Killed
        calls.append(params)
        config = params["config"]
        best = 0.01 if params["data"] == A else 0.5  # the two data sets prefer different user ridges
        score = (
            1.0
            + 0.1
            * (math.log10(training.tuned_values(params["method"], config, {})["lambda_u"]) - math.log10(best)) ** 2
        )
        return value(
            score + 0.001 * (params["seed"] >= training.TEST_SEED) * (params["seed"] - training.TEST_SEED),
            spent=params["epsilon"],
        )

    monkeypatch.setattr(training, "run_cell", run)


def test_an_interrupted_study_resumes_without_rerunning_finished_trials(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIX)
    methods = dict(seeds=1, progress=False, data=DATA, methods=["als", "ssp"])
    whole = []
    fake_training(monkeypatch, whole)
    harness.run_experiment("privacy-utility", str(tmp_path / "whole"), **methods)
    assert len(whole) == 2 * 6 + 2  # 6 trials per study, one test run each

    first = []
    fake_training(monkeypatch, first, kill_at=8)  # killed in the third trial of the second study
    with pytest.raises(Killed):
        harness.run_experiment("privacy-utility", str(tmp_path / "cut"), **methods)
    assert (
        len(harness.Results(str(tmp_path / "cut")).cells) == 8
    )  # every finished trial was recorded; the one in flight is lost
    again = []
    fake_training(monkeypatch, again)
    harness.run_experiment("privacy-utility", str(tmp_path / "cut"), **methods)
    assert len(again) == 14 - 8 and not [p for p in again if p in first]  # nothing finished runs twice
    # the resumed studies suggested what the uninterrupted ones did: the same cells, the same choice
    assert first + again == whole
    assert harness.Results(str(tmp_path / "cut")).cells.keys() == harness.Results(str(tmp_path / "whole")).cells.keys()
    assert (tmp_path / "cut" / "results.csv").read_text() == (tmp_path / "whole" / "results.csv").read_text()


def test_failed_trials_are_recorded_and_never_chosen_but_the_defaults_must_run(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIX)
    calls = []

    def diverging(out, params):
        calls.append(params)
        if params["seed"] in (2, 3):
            raise ValueError("predictions and labels must be finite")
        return value(1.0 - 0.01 * params["seed"] if params["seed"] < training.TEST_SEED else 0.9)

    monkeypatch.setattr(training, "run_cell", diverging)
    harness.run_experiment("privacy-utility", str(tmp_path), seeds=1, progress=False, data=DATA, methods=["ssp"])
    results = harness.Results(str(tmp_path))
    trials = privacy_utility.study(results, DATA, "rmse", "ssp", 1.0, size=SIX)
    assert [bool(t["value"].get("failed")) for t in trials] == [False, False, True, True, False, False]
    assert "ValueError: predictions and labels must be finite" in trials[2]["value"]["failed"]
    assert privacy_utility.best_trial([t["value"] for t in trials], "rmse") == 5
    assert "**Failed trials**" in (tmp_path / "report.md").read_text() and len(calls) == 7  # rerunning computes nothing
    harness.run_experiment("privacy-utility", str(tmp_path), seeds=1, progress=False, data=DATA, methods=["ssp"])
    assert len(calls) == 7

    monkeypatch.setattr(
        training, "run_cell", lambda out, params: (_ for _ in ()).throw(ValueError("the defaults are broken"))
    )
    with pytest.raises(ValueError, match="the defaults are broken"):
        harness.run_experiment(
            "privacy-utility", str(tmp_path / "other"), seeds=1, progress=False, data=DATA, methods=["als"]
        )


def test_transfer_mode_runs_the_settings_chosen_on_a_on_b_and_both_modes_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIX)
    calls = []
    fake_training(monkeypatch, calls)
    out = str(tmp_path)
    harness.run_experiment(
        "privacy-utility", out, seeds=2, progress=False, data=DATA, tune_on=A, methods=["nonprivate-als", "ssp"]
    )
    trials = [p for p in calls if p["seed"] < training.TEST_SEED]
    tests = [p for p in calls if p["seed"] >= training.TEST_SEED]
    assert len(trials) == 2 * 6 and {p["data"] for p in trials} == {
        A
    }  # tuning touched only A: B's privacy is not spent on it
    assert len(tests) == 2 * 2 and {p["data"] for p in tests} == {DATA}
    results = harness.Results(out)
    for name, eps in (("nonprivate-als", None), ("ssp", 1.0)):
        on_a = privacy_utility.tuned_config(results, A, "rmse", name, eps, SIX)
        assert [p["config"] for p in tests if p["method"] == name] == [on_a] * 2
    with open(tmp_path / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["mode"], r["tuned_on"], r["method"]) for r in table] == [
        ("transfer", A, "nonprivate-als"),
        ("transfer", A, "ssp"),
    ]

    # then the direct mode into the same folder: tuned on B itself; the report and table hold both
    harness.run_experiment(
        "privacy-utility", out, seeds=2, progress=False, data=DATA, methods=["nonprivate-als", "ssp"]
    )
    direct = privacy_utility.tuned_config(harness.Results(out), DATA, "rmse", "ssp", 1.0, SIX)
    assert direct != privacy_utility.tuned_config(harness.Results(out), A, "rmse", "ssp", 1.0, SIX)
    with open(tmp_path / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["mode"], r["method"]) for r in table] == [
        ("direct", "nonprivate-als"),
        ("transfer", "nonprivate-als"),
        ("direct", "ssp"),
        ("transfer", "ssp"),
    ]
    # the fake prefers lambda_u 0.5 on B: tuning on B itself does better on B than the settings transferred from A
    assert float(table[2]["mean"]) < float(table[3]["mean"])
    report = (tmp_path / "report.md").read_text()
    assert "| AM-SSP | transfer: tuned on synth-a | 1 |" in report and "| AM-SSP | direct | 1 |" in report
    assert "**Who wins (direct).**" in report and "**Who wins (transfer: tuned on synth-a).**" in report
    collected = privacy_utility.collect(
        harness.Context(out, False, 2, harness.Results(out), False, DATA, "rmse", ["nonprivate-als", "ssp"])
    )
    assert [m["mode"] for m in privacy_utility.modes(collected)] == ["direct", "transfer"]
    fig = privacy_utility.plot(collected, "rmse")
    assert "AM-SSP [transfer: tuned on synth-a] (mean ± std, 2 seeds)" in [
        t.get_text() for t in fig.axes[0].get_legend().get_texts()
    ]
    plt.close(fig)


def test_dp_popularity_reported_for_recall_and_skipped_for_rmse(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIZE)
    forbid_training(monkeypatch)
    fill_privacy_utility(
        str(tmp_path),
        "recall",
        {
            ("dp-popularity", 1.0): [0.10, 0.12],
            ("dp-popularity", 10.0): [0.11, 0.11],
            ("ssp", 1.0): [0.05, 0.07],
            ("ssp", 10.0): [0.20, 0.22],
        },
    )
    harness.run_experiment(
        "privacy-utility",
        str(tmp_path),
        seeds=2,
        progress=False,
        data=DATA,
        protocol="recall",
        methods=["dp-popularity", "ssp"],
    )
    report = (tmp_path / "report.md").read_text()
    assert (
        "| DP popularity | direct | 1 | 0.11 |" in report
        and "**DP popularity** ranks every candidate by the run's DP item count" in report
    )
    assert (
        "epsilon = 1: DP popularity wins with test Recall@20 0.1100" in report and "epsilon = 10: AM-SSP wins" in report
    )
    assert "count_share log 0.02..0.3, max_items_per_user log 20..400 (integer)" in report

    harness.run_experiment(
        "privacy-utility", str(tmp_path / "rmse"), seeds=2, progress=False, data=DATA, methods=["dp-popularity"]
    )
    report = (tmp_path / "rmse" / "report.md").read_text()
    assert (
        "**Not run under protocol `rmse`**: DP popularity (protocol recall only)." in report
        and "| DP popularity |" not in report
    )


def test_epsilons_select_the_studies(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: {**SIX, "epsilons": [1.0, 5.0, 10.0]})
    calls = []
    fake_training(monkeypatch, calls)
    harness.run_experiment(
        "privacy-utility", str(tmp_path), seeds=1, progress=False, data=DATA, methods=["ssp"], epsilons=[5.0]
    )
    assert {p["epsilon"] for p in calls} == {5.0} and len(calls) == 7
    harness.run_experiment(
        "privacy-utility", str(tmp_path), seeds=1, progress=False, data=DATA, methods=["ssp"], epsilons=[1.0, 5.0]
    )
    assert len(calls) == 14 and {p["epsilon"] for p in calls[7:]} == {1.0}  # epsilon 5 reused


def ranked(test: float, recall_at_50: float, ndcg: float, coverage: float, spent: float) -> dict:
    """A ranking cell as bench.training records it now: every ranking metric beside Recall@20."""
    metrics = {"recall_at_20": test, "recall_at_50": recall_at_50, "ndcg_at_100": ndcg, "coverage_at_20": coverage}
    return {**value(test, spent=spent), "ranking": {"valid": metrics, "test": metrics}}


def test_the_recall_table_shows_the_other_ranking_metrics_and_a_dash_for_older_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIZE)
    forbid_training(monkeypatch)
    fill_privacy_utility(
        str(tmp_path),
        "recall",
        {
            ("ssp", 1.0): [ranked(0.10, 0.20, 0.30, 0.05, 1.0), ranked(0.12, 0.22, 0.40, 0.07, 1.0)],
            ("ssp", 10.0): [ranked(0.20, 0.30, 0.50, 0.10, 10.0), 0.22],  # the second cell predates the new metrics
        },
    )
    harness.run_experiment(
        "privacy-utility", str(tmp_path), seeds=2, progress=False, data=DATA, protocol="recall", methods=["ssp"]
    )
    report = (tmp_path / "report.md").read_text()
    assert (
        "| method | mode | epsilon | test Recall@20 mean | std | seeds | epsilon spent | test Recall@50 mean | "
        "test NDCG@100 mean | test coverage@20 mean |" in report
    )
    assert "| AM-SSP | direct | 1 | 0.11 | 0.01414 | 2 | 1 | 0.21 | 0.35 | 0.06 |" in report
    assert "| AM-SSP | direct | 10 | 0.21 | 0.01414 | 2 | 10 | - | - | - |" in report
    with open(tmp_path / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [float(table[0][key]) for key in ("recall_at_50", "ndcg_at_100", "coverage_at_20")] == pytest.approx(
        [0.21, 0.35, 0.06]
    )
    assert (table[1]["recall_at_50"], table[1]["ndcg_at_100"], table[1]["coverage_at_20"]) == ("", "", "")
    rows = json.loads((tmp_path / "results_table.json").read_text())["rows"]
    assert rows[0]["ndcg_at_100"] == pytest.approx(0.35) and rows[1]["ndcg_at_100"] is None
    # the rmse table has no such columns
    fill_privacy_utility(str(tmp_path / "rmse"), "rmse", {("ssp", 1.0): [1.0], ("ssp", 10.0): [0.9]})
    harness.run_experiment(
        "privacy-utility", str(tmp_path / "rmse"), seeds=1, progress=False, data=DATA, methods=["ssp"]
    )
    assert "NDCG" not in (tmp_path / "rmse" / "report.md").read_text()
    with open(tmp_path / "rmse" / "results.csv") as handle:
        assert "recall_at_50" not in next(csv.reader(handle))


def test_trials_one_is_a_study_of_every_method_at_its_defaults(tmp_path):
    """--trials 1: each (method, epsilon) study is trial 0 alone, the defaults, which its test runs then use."""
    ctx = harness.Context(str(tmp_path), False, 2, harness.Results(str(tmp_path)), False, DATA, "recall", trials=1)
    size = privacy_utility.size_of(ctx)
    assert size["trials"] == 1 and privacy_utility.size_of(dataclasses.replace(ctx, trials=None))["trials"] == 12
    trials = privacy_utility.study(ctx.results, DATA, "recall", "gram", 5.0, size=size, compute=lambda p: value(0.2))
    assert [t["params"]["config"] for t in trials] == [training.cell_config("gram", size["base"], {})]
