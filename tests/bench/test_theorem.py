"""Utility-theorem experiment: projections and optimum by hand, schedules, and the predicted direction."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from bench import harness, theorem
from privacy.accounting import epsilon_of, gaussian_event


def test_projections_by_hand():
    # m = 1, p = 2, X = [1, 0], theta = (3, 4)^T: V = 3, null-space part (0, 4)
    x = np.array([[1.0, 0.0]])
    theta = np.array([[3.0], [4.0]])
    # the paper's Theta: clip V to r = 1, keep the null-space part
    np.testing.assert_allclose(theorem.project(x, theta, "free"), [[1.0], [4.0]])
    # within the ball of radius r sqrt(m) = 1: (9 + 16) / (1 + mu)^2 = 1 -> mu = 4, theta / 5
    np.testing.assert_allclose(theorem.project(x, theta, "ball"), [[0.6], [0.8]], atol=1e-9)
    # a point already inside is left alone
    np.testing.assert_allclose(theorem.project(x, np.array([[0.3], [0.4]]), "ball"), [[0.3], [0.4]])


def test_optimum_by_hand():
    # one item, d = 1: 1/2 * 2 v^2 - v is minimised at v = 1/2 (inside ||v|| <= 1): -1/4
    assert theorem.optimum({"const": 1.0, "a": np.array([[[2.0]]]), "b": np.array([[1.0]])}) == pytest.approx(0.75)
    # A = diag(1, 4), b = (4, 0): unconstrained v = (4, 0) is outside; on the sphere v = (1, 0): 1/2 - 4
    a = np.array([[[1.0, 0.0], [0.0, 4.0]]])
    assert theorem.optimum({"const": 0.0, "a": a, "b": np.array([[4.0, 0.0]])}) == pytest.approx(-3.5)
    # singular A = diag(1, 0): b = (1/2, 0) has its minimiser (1/2, 0) inside; b = (0, 1) lies in the
    # null space, so the loss falls without bound along it until the boundary: v = (0, 1)
    singular = np.array([[1.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(theorem.trust_region(singular, np.array([0.5, 0.0]), 1.0), [0.5, 0.0], atol=1e-9)
    np.testing.assert_allclose(theorem.trust_region(singular, np.array([0.0, 1.0]), 1.0), [0.0, 1.0], atol=1e-9)


def test_loss_from_statistics_equals_the_squared_loss_over_rows():
    problem = theorem.make_problem(m=3, p=5, d=2, rows=30, seed=0)
    np.testing.assert_allclose(problem["x"] @ problem["x"].T, np.eye(3), atol=1e-12)
    theta = np.random.default_rng(1).normal(size=(5, 2))
    v = problem["x"] @ theta
    direct = 0.5 * np.sum((np.einsum("id,id->i", problem["u"], v[problem["items"]]) - problem["y"]) ** 2)
    assert theorem.loss(problem, theta) == pytest.approx(direct)


def test_schedules_by_hand():
    size = {"m": 8, "d": 2, "rows": 1200, "epsilon": 1.0, "delta": 1e-5}
    # rho^2 = 8 ln(1e5) = 92.10; SSP1: T = ceil(1200^2 / (8 * 2 * 92.10)) = ceil(977.2); GD at p = 2048: ceil(3.82)
    ssp1, gd = theorem.schedule("ssp1", size, 2048), theorem.schedule("gd", size, 2048)
    assert (ssp1["steps"], ssp1["events"], gd["steps"], gd["events"]) == (978, 1956, 4, 4)
    for plan in (ssp1, gd):
        assert epsilon_of([gaussian_event(plan["sigma"], plan["events"])], 1e-5, "rdp") == pytest.approx(1.0, abs=1e-3)
    # the bounds' ratio is sqrt(p/m) / 2 = sqrt(256) / 2
    assert gd["bound"] / ssp1["bound"] == pytest.approx(8.0)


def test_quick_run_ssp1_beats_noisy_gd_at_large_p(tmp_path):
    """The theorem's prediction: noisy GD's excess risk grows with p, SSP1's does not, so at large p
    SSP1 is lower, on every seed and by a wide margin on average."""
    harness.run_experiment("theorem", str(tmp_path), quick=True, seeds=3, progress=False)
    size = theorem.sizes(True)
    results = harness.Results(str(tmp_path))
    values = [results.get("theorem", params) for params in theorem.cell_params(size, 3)]
    assert len(results.cells) == len(values) == len(size["ratios"]) * 3
    excess = theorem.summarize(size, values, 3)
    largest, smallest = excess["ssp1"][-1], excess["gd"][0]
    assert np.all(excess["gd"][-1] > largest)
    assert excess["gd"][-1].mean() > 3 * largest.mean()
    assert excess["gd"][-1].mean() > 3 * smallest.mean()
    assert max(e.mean() for e in excess["ssp1"]) < 2.5 * min(e.mean() for e in excess["ssp1"])

    report = (tmp_path / "report.md").read_text()
    assert "(theorem_excess_risk.png)" in report and "Expected shape" in report
    assert plt.imread(str(tmp_path / "theorem_excess_risk.png")).ndim == 3
    fig = theorem.plot(size, excess)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "public features over items, p/m (ratio)"
    assert ax.get_ylabel() == "excess empirical risk per example (squared-loss units)"
    assert len(ax.get_legend().get_texts()) == len(theorem.RUNS)
    plt.close(fig)
