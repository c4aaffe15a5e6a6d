"""The federated benchmark: cumulative rounds and uploads, rounds and bytes to the common RMSE, the
report from hand-made cells (the end-to-end run is a slow case)."""

import os

import pytest

from bench import federated_quality, harness


def _cell(tests, traffic, prepare_upload=1_000):
    return {
        "rows": 1000,
        "items": 50,
        "test": tests[-1],
        "mean_predictor": 1.2,
        "prepare_upload": prepare_upload,
        "trajectory": [{"step": s, "test": v} for s, v in enumerate(tests)],
        "traffic": traffic,
    }


SSP = _cell(
    [1.0, 0.93, 0.90], [{"rounds": 1, "upload": 2e6, "download": 1e5}, {"rounds": 1, "upload": 2e6, "download": 1e5}]
)
DPSGD = _cell(
    [1.0, 0.97, 0.95],
    [
        {"rounds": 40, "upload": 5e5, "download": 3e5, "parameters": 900},
        {"rounds": 40, "upload": 5e5, "download": 3e5, "parameters": 900},
    ],
)


def test_cumulative_rounds_and_uploads_start_after_the_prepare_rounds():
    rounds, upload, rmse = federated_quality.cumulative(SSP)
    assert rounds == [2, 3, 4] and upload == pytest.approx([0.001, 2.001, 4.001]) and rmse == [1.0, 0.93, 0.90]


def test_rounds_and_upload_to_the_worse_final_rmse():
    summary = federated_quality.summarize({"ssp": SSP, "dpsgd": DPSGD})
    # target 0.95 (DP-SGD's final): SSP2 reaches it after its first step (3 rounds, 2.001 MB), DP-SGD after its last (82
    # rounds, 1.001 MB)
    assert summary == {
        "target": 0.95,
        "ssp": {"rounds": 3, "upload_mb": pytest.approx(2.001)},
        "dpsgd": {"rounds": 82, "upload_mb": pytest.approx(1.001)},
    }


def test_secure_aggregation_overhead_is_a_key_and_three_shares_per_neighbour():
    assert federated_quality.secagg_overhead(64) == 32 + 3 * 12 * 66  # 12 neighbours in a cohort of 64


def test_the_report_from_stored_cells(tmp_path):
    results = harness.Results(str(tmp_path))
    for params in federated_quality.cells(quick=True):
        results.put(federated_quality.NAME, params, SSP if params["method"] == "ssp" else DPSGD)
    text = federated_quality.run(harness.Context(str(tmp_path), True, 1, results, progress=False)).markdown()
    assert "| 300 | 0.9500 | 3 | 82 | 2 | 1 |" in text  # target, rounds (SSP2, DP-SGD), uploads (SSP2, DP-SGD)
    assert "needs 3 rounds against 82 (27x fewer)" in text and os.path.exists(tmp_path / "federated_rounds_bytes.png")


@pytest.mark.slow
def test_quick_federated_bench_runs_the_real_pipeline(tmp_path):
    harness.run_experiment(federated_quality.NAME, str(tmp_path), quick=True, seeds=1, progress=False)
    cells = {c["params"]["method"]: c["value"] for c in harness.Results(str(tmp_path)).cells.values()}
    assert set(cells) == {"ssp", "dpsgd"}
    assert all(step["rounds"] == 1 for step in cells["ssp"]["traffic"]) and all(
        step["rounds"] > 1 for step in cells["dpsgd"]["traffic"]
    )
    assert (
        cells["dpsgd"]["traffic"][0]["parameters"] > 0
        and len(cells["ssp"]["trajectory"]) == len(cells["ssp"]["traffic"]) + 1
    )
