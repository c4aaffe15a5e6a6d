"""Cost model on hand-computed values, its figures, and the timed proxy on a tiny data set."""

import json

import matplotlib.pyplot as plt
import numpy as np
import pytest

from bench import complexity, harness


def test_beta_by_hand():
    # two items, p = (1/2, 1/2), D = 4: B = 2 -> 4/2 (1 - 1/4) = 1.5 each
    np.testing.assert_allclose(complexity.beta_items([0.5, 0.5], 4, 2), [1.5, 1.5])
    # p = (3/4, 1/4), D = 8, B = 2: 4 (1 - 1/16) = 3.75 and 4 (1 - 9/16) = 1.75
    np.testing.assert_allclose(complexity.beta_items([0.75, 0.25], 8, 2), [3.75, 1.75])
    # B = 1: every batch is one example, beta = D; B = D = 4: 1 - (1/2)^4 = 0.9375 each
    assert complexity.beta_items([0.5, 0.5], 4, 1).sum() == pytest.approx(4.0)
    np.testing.assert_allclose(complexity.beta_items([0.5, 0.5], 4, 4), [0.9375, 0.9375])


def test_cost_ratio_by_hand():
    # beta = 50, D = 1000, m = 10, d = 2, e = 5
    # c = d^2 = 4: (1000*4 + 5*10*(4+4)) / (4*5*50) = 4400 / 1000, also (D + 2em) / (e beta) = 1100 / 250
    assert complexity.cost_ratio(50, 1000, 10, 2, 4, 5) == pytest.approx(4.4)
    # c = d = 2: (4000 + 5*10*(2+4)) / (2*5*50) = 4300 / 500
    assert complexity.cost_ratio(50, 1000, 10, 2, 2, 5) == pytest.approx(8.6)


def test_power_law_frequencies_by_hand():
    # m = 2, alpha = 2: upper quantiles 1/4 and 3/4 -> counts 4 and 4/3 -> frequencies 3/4, 1/4
    np.testing.assert_allclose(complexity.power_law_frequencies(2, 2.0), [0.75, 0.25])
    # alpha = 3: counts (1/4)^(-1/2) = 2 and (3/4)^(-1/2) = 2/sqrt(3)
    np.testing.assert_allclose(
        complexity.power_law_frequencies(2, 3.0), np.array([2, 2 / np.sqrt(3)]) / (2 + 2 / np.sqrt(3))
    )
    with pytest.raises(ValueError):
        complexity.power_law_frequencies(2, 1.0)


@pytest.mark.parametrize("plot", [complexity.plot_item_visits, complexity.plot_cost_ratio])
def test_model_figures_have_titles_unit_labels_and_legends(plot):
    fig = plot()
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel().endswith(")") and ax.get_ylabel().endswith(")")
        assert ax.get_legend() is not None
    plt.close(fig)


TINY = {"rows": 4000, "items": 40, "d": 4, "alpha": 2.0, "batch_sizes": [50], "item_batch": 16}


def test_timed_run_writes_section_figures_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(complexity, "measured_sizes", lambda quick: TINY)
    calls = []
    timed = complexity.time_epochs
    monkeypatch.setattr(complexity, "time_epochs", lambda params: calls.append(params) or timed(params))
    out = str(tmp_path)
    harness.run_experiment("complexity", out, quick=True, seeds=1, progress=False)
    harness.run_experiment("complexity", out, quick=True, seeds=1, progress=False)
    assert len(calls) == 1  # the second run reuses the finished cell

    cell = next(iter(json.loads((tmp_path / "results.json").read_text())["cells"].values()))["value"]
    assert cell["ssp2_epoch_seconds"] > 0 and cell["stats_seconds"] > 0 and cell["dpsgd"]["50"]["epoch_seconds"] > 0
    # distinct items per batch, summed over the epoch's 80 batches, against the with-replacement model
    assert cell["dpsgd"]["50"]["item_visits"] == pytest.approx(cell["dpsgd"]["50"]["model_beta"], rel=0.05)
    report = (tmp_path / "report.md").read_text()
    for name in ("item_visits", "cost_ratio", "measured"):
        assert f"(complexity_{name}.png)" in report
        assert (tmp_path / f"complexity_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "proxy" in report and "not TF-Privacy" in report

    fig = complexity.plot_measured(TINY, [cell])
    (ax,) = fig.axes
    assert ax.get_xlabel() == "epochs e (epochs)" and ax.get_ylabel() == "time ratio SSP2 / DP-SGD proxy (ratio)"
    assert any(t.get_text().startswith("measured, B = 50") for t in ax.get_legend().get_texts())
    plt.close(fig)
