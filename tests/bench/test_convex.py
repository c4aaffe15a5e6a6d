"""The SSP-convex benchmark: its cells and the report from hand-made cells (the end-to-end run is a
slow case)."""

import os

import pytest

from bench import convex, harness


def test_cells_are_every_method_at_every_epsilon_and_each_losss_non_private_top_line():
    params = convex.cells(quick=False)
    private = {(p["method"], p["epsilon"]) for p in params if p["epsilon"] is not None}
    assert private == {(m, e) for m in convex.METHODS for e in convex.EPSILONS}
    assert {p["method"] for p in params if p["epsilon"] is None} == set(convex.NON_PRIVATE)
    by_method = {p["method"]: p["config"] for p in params}
    assert (
        by_method["ssp-logistic"] == {"item_update": "ssp", "loss": "logistic"}
        and by_method["dpsgd-logistic"]["item_update"] == "dpsgd"
    )


def test_the_report_from_stored_cells(tmp_path):
    results = harness.Results(str(tmp_path))
    value = {"ssp-square": 0.10, "ssp-logistic": 0.12, "dpsgd-logistic": 0.05, "dp-popularity": 0.11}
    for p in convex.cells(quick=True):
        test = value[p["method"]] * (2 if p["epsilon"] is None else 1)
        results.put(
            convex.NAME,
            p,
            {
                "valid": test,
                "test": test,
                "test_sliced": [0.0, None, 0.1, 0.2, 0.3],
                "epsilon_spent": p["epsilon"],
                "seconds": 1.0,
            },
        )
    text = convex.run(harness.Context(str(tmp_path), True, 1, results, progress=False)).markdown()
    assert (
        "| SSP-convex, logistic loss | 0.1200 | 0.2400 |" in text and "| DP-SGD, logistic loss | 0.0500 | - |" in text
    )
    assert (
        "| DP popularity (baseline) | 0.1100 | - |" in text
        and "| SSP-convex, logistic loss | 5 | 0.0000 | - | 0.1000 | 0.2000 | 0.3000 |" in text
    )
    assert os.path.exists(tmp_path / "convex_recall_vs_epsilon.png")


@pytest.mark.slow
def test_quick_convex_bench_runs_the_real_pipeline(tmp_path):
    harness.run_experiment(convex.NAME, str(tmp_path), quick=True, seeds=1, progress=False)
    cells = [c for c in harness.Results(str(tmp_path)).cells.values()]
    assert len(cells) == len(convex.cells(quick=True)) and all(0 <= c["value"]["test"] <= 1 for c in cells)
