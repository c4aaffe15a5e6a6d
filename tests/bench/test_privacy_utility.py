"""Privacy-utility: tuning choice, winners by hand, the table files, the report and plot from hand-made cells."""

import csv
import json
import math

import matplotlib.pyplot as plt
import pytest
from handmade import DATA, SIZE, fill_privacy_utility, forbid_training, value

from bench import harness, privacy_utility, training


def row(method, eps, mean, std):
    return {"method": method, "epsilon": eps, "mean": mean, "std": std}


def test_winners_by_hand_lower_and_higher_is_better():
    rows = [row("nonprivate-ssp", math.inf, 0.80, 0.0), row("als", 1.0, 0.95, 0.02), row("ssp", 1.0, 0.90, 0.01), row("cmf", 1.0, 0.97, 0.0),
            row("als", 5.0, 0.88, 0.01)]
    first, second = privacy_utility.winners(rows, "rmse")
    assert (first["epsilon"], first["winner"], first["runner_up"]) == (1.0, "ssp", "als")  # the top line never "wins"
    assert first["margin"] == pytest.approx(0.05)
    # pooled std sqrt((0.01^2 + 0.02^2) / 2) = 0.01581: 0.05 / 0.01581 = 3.16
    assert privacy_utility.winner_text(first, "rmse") == (
        "epsilon = 1: AM-SSP wins with test RMSE 0.9000 ± 0.0100, below the runner-up DP-ALS (0.9500 ± 0.0200) by 0.0500 (3.2 pooled stds).")
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


def test_every_method_gets_the_same_trial_budget():
    params = [privacy_utility.trial_params(DATA, "rmse", name, eps, SIZE) for name, eps in privacy_utility.groups(list(training.METHODS), SIZE)]
    assert {len(p) for p in params} == {SIZE["trials"]}
    # top lines once, private methods at every epsilon
    assert privacy_utility.groups(["nonprivate-als", "als"], SIZE) == [("nonprivate-als", None), ("als", 1.0), ("als", 10.0)]


def test_report_table_and_plot_from_handmade_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIZE)
    forbid_training(monkeypatch)
    out = str(tmp_path)
    tests = {("nonprivate-als", None): [value(0.80, spent=None), value(0.82, spent=None)], ("als", 1.0): [1.10, 1.20], ("als", 10.0): [0.95, 0.97],
             ("ssp", 1.0): [1.00, 1.02], ("ssp", 10.0): [0.97, 0.97]}
    chosen = fill_privacy_utility(out, "rmse", tests, valids={("ssp", 1.0): [0.5, 0.7]})
    assert chosen[("ssp", 1.0)] == training.cell_config("ssp", SIZE["base"], {})  # the defaults (trial 0) validated best
    results = harness.Results(out)
    assert privacy_utility.tuned_config(results, DATA, "rmse", "ssp", 1.0, SIZE) == chosen[("ssp", 1.0)]
    assert privacy_utility.tuned_config(results, DATA, "rmse", "ssp", 5.0, SIZE) is None

    harness.run_experiment("privacy-utility", out, seeds=2, progress=False, data=DATA, methods=["nonprivate-als", "als", "ssp"])
    with open(tmp_path / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["method"], r["epsilon"], r["n_seeds"], r["epsilon_spent"]) for r in table] == [
        ("nonprivate-als", "inf", "2", "inf"), ("als", "1.0", "2", "1.0"), ("als", "10.0", "2", "10.0"), ("ssp", "1.0", "2", "1.0"), ("ssp", "10.0", "2", "10.0")]
    assert float(table[1]["mean"]) == pytest.approx(1.15) and float(table[1]["std"]) == pytest.approx(0.0707107)
    assert json.loads((tmp_path / "results_table.json").read_text())["rows"][3]["mean"] == pytest.approx(1.01)

    report = (tmp_path / "report.md").read_text()
    assert "**Tuning budget: 2 runs per method and epsilon, the same for every method**" in report
    assert "epsilon = 1: AM-SSP wins with test RMSE 1.0100 ± 0.0141, below the runner-up DP-ALS (1.1500 ± 0.0707) by 0.1400" in report
    assert "epsilon = 10: DP-ALS wins with test RMSE 0.9600 ± 0.0141, below the runner-up AM-SSP (0.9700 ± 0.0000) by 0.0100 (1.0 pooled stds)." in report
    assert "(privacy_utility_rmse.png)" in report and plt.imread(str(tmp_path / "privacy_utility_rmse.png")).ndim == 3

    collected = privacy_utility.collect(harness.Context(out, False, 2, results, False, DATA, "rmse", ["nonprivate-als", "als", "ssp"]))
    fig = privacy_utility.plot(collected, "rmse")
    (ax,) = fig.axes
    assert ax.get_xlabel() == "privacy budget, user level, delta = 1e-05 (epsilon)" and ax.get_ylabel() == "test RMSE (rating stars)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "non-private ALS (id) (mean ± std)", "DP-ALS (mean ± std, 2 seeds)", "AM-SSP (mean ± std, 2 seeds)"]
    plt.close(fig)


def test_methods_pipelines_train_lacks_are_named_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIZE)
    monkeypatch.setitem(training.METHODS, "future", training.Method("Future", {"item_update": "future", "encoder": "id"}, {"dim": [8]}))
    forbid_training(monkeypatch)
    fill_privacy_utility(str(tmp_path), "recall", {("als", 1.0): [0.1], ("als", 10.0): [0.2]})
    harness.run_experiment("privacy-utility", str(tmp_path), seeds=1, progress=False, data=DATA, protocol="recall", methods=["als", "future"])
    report = (tmp_path / "report.md").read_text()
    assert "**Not run** (pipelines.train has no such item update yet): Future (`future`)." in report
    assert "epsilon = 10: DP-ALS wins with test Recall@20 0.2000 ± 0.0000 (the only private method run)." in report
