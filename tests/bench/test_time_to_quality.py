"""Time to quality: interpolated crossing times, the common target, the ratio, the plot and report."""

import matplotlib.pyplot as plt

from bench import harness, privacy_utility, time_to_quality
from tests.bench.handmade import DATA, SIZE, fill_privacy_utility, forbid_training, value


def test_time_to_reach_is_the_first_trained_step_as_good():
    assert time_to_quality.time_to_reach([1, 2, 4], [1.0, 0.9, 0.8], 0.85, True) == 4.0
    assert time_to_quality.time_to_reach([1, 2, 4], [1.0, 0.85, 0.8], 0.85, True) == 2.0
    # step 0 (the untrained encoder) does not count, however good
    assert time_to_quality.time_to_reach([1, 2, 4], [0.7, 0.9, 0.8], 0.85, True) == 4.0
    assert time_to_quality.time_to_reach([1, 2], [1.0, 0.9], 0.85, True) is None
    assert time_to_quality.time_to_reach([0, 10, 20], [0.1, 0.3, 0.2], 0.25, False) == 10.0  # Recall: higher is better


def test_common_target_is_the_worse_best_trained_point():
    assert time_to_quality.common_target({"ssp": [1.0, 0.8, 0.9], "dpsgd": [0.5, 0.85]}, True) == 0.85
    assert time_to_quality.common_target({"ssp": [0.1, 0.3], "dpsgd": [0.9, 0.25, 0.2]}, False) == 0.25


def test_epsilon_nearest_ten_on_a_log_scale():
    assert time_to_quality.epsilon_of({"epsilons": [1.0, 5.0, 10.0, 20.0]}) == 10.0
    assert time_to_quality.epsilon_of({"epsilons": [1.0, 20.0]}) == 20.0  # log 2 < log 10
    assert time_to_quality.epsilon_of({"epsilons": [5.0]}) == 5.0


def test_ratio_and_plot_from_handmade_curves():
    results = {
        "ssp": {
            "cells": [
                value(0.8, times=(1.0, 2.0, 3.0), steps=[1.0, 0.86, 0.8]),
                value(0.8, times=(1.0, 2.0, 3.0), steps=[1.0, 0.84, 0.8]),
            ]
        },
        "dpsgd": {"cells": [value(0.85, times=(10.0, 100.0, 1000.0), steps=[1.0, 0.9, 0.85])]},
    }
    summary = time_to_quality.summarize(results, "rmse")
    # target 0.85 (DP-SGD's best); AM-SSP's mean reaches it at its first trained step (mean of 0.86 and 0.84)
    assert summary["target"] == 0.85 and summary["times"] == {"ssp": 2.0, "dpsgd": 1000.0} and summary["ratio"] == 500.0
    fig = time_to_quality.plot(summary, "rmse", 10.0, 2)
    (ax,) = fig.axes
    assert (
        ax.get_xlabel() == "wall-clock time since the run started (s)" and ax.get_ylabel() == "test RMSE (rating stars)"
    )
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "AM-SSP, outer steps 0..2 (mean ± std, 2 seeds)",
        "AM-DPSGD, outer steps 0..2 (mean ± std, 1 seeds)",
        "common target RMSE 0.8500",
    ]
    plt.close(fig)


def test_tuned_runs_are_the_privacy_utility_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIZE)
    forbid_training(monkeypatch)
    cells = [value(0.9, times=(1.0, 4.0), steps=[0.8, 0.9]), value(0.92, times=(1.0, 4.0), steps=[0.8, 0.92])]
    fill_privacy_utility(str(tmp_path), "rmse", {("ssp", 10.0): cells})
    harness.run_experiment("time-to-quality", str(tmp_path), seeds=2, progress=False, data=DATA, methods=["ssp"])
    report = (tmp_path / "report.md").read_text()
    assert "| AM-SSP | tuned (privacy-utility) |" in report and "| 0.8000 | 0.9100 ± 0.0141 | 4.0 | 4.0 |" in report
    assert "**Note:** the final model of AM-SSP is worse on test than its step-0 encoder" in report
    assert "(time_to_quality_rmse.png)" in report and "**Ratio:** not computed: AM-DPSGD did not run" in report
