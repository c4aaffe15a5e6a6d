"""Perf: the two benchmarks at tiny sizes in the harness, their targets in the report, resumed cells."""

import json
import os

import matplotlib.pyplot as plt

from bench import harness, perf

TINY = {
    "stats": {
        "rows": 6_000,
        "ratings_per_user": 30,
        "items": 300,
        "dim": 8,
        "alpha": 1.0,
        "seed": 0,
        "gemm_n": 200,
        "repeats": 1,
        "shards": 2,
        "spark_runs": 1,
    },
    "memory": {"items": [100, 1_000], "dim": 4},
}


def test_tiny_perf_reports_targets_and_resumes(tmp_path, spark, monkeypatch):
    monkeypatch.setattr(perf, "sizes", lambda quick: TINY)
    calls = []
    for name in ("stats_cell", "memory_cell"):
        real = getattr(perf, name)
        monkeypatch.setattr(perf, name, lambda params, real=real: calls.append(params["benchmark"]) or real(params))
    before = os.environ.get("PYSPARK_SUBMIT_ARGS")
    harness.run_experiment("perf", str(tmp_path), quick=True, progress=False)
    harness.run_experiment("perf", str(tmp_path), quick=True, progress=False)
    assert calls == ["stats_throughput", "trainer_memory"]
    assert os.environ.get("PYSPARK_SUBMIT_ARGS") == before

    cells = {
        c["params"]["benchmark"]: c["value"]
        for c in json.loads((tmp_path / "results.json").read_text())["cells"].values()
    }
    stats, memory = cells["stats_throughput"], cells["trainer_memory"]
    assert stats["kernel_fraction"] == stats["kernel_unsorted_gflops"] / stats["gemm_gflops"] > 0
    assert stats["spark_over_kernel"] == stats["spark_end_to_end_s"] / stats["kernel_unsorted_s"] > 0
    assert [r["items"] for r in memory["runs"]] == [100, 1_000] and all(r["peak_rss_mib"] > 0 for r in memory["runs"])

    report = (tmp_path / "report.md").read_text()
    assert (
        "| kernel rate / GEMM rate (file order) |" in report
        and ">= 0.50" in report
        and "<= 2.0" in report
        and "< 2048 MiB" in report
    )
    fig = perf.plot(stats, memory)
    rates, peaks = fig.axes
    assert (
        rates.get_ylabel() == "rate (GFLOP/s)"
        and peaks.get_ylabel() == "peak resident memory (MiB)"
        and peaks.get_xlabel() == "catalog items (items)"
    )
    assert any(t.get_text() == "target: 50% of GEMM" for t in rates.get_legend().get_texts())
    assert any(t.get_text() == "target: 2048 MiB" for t in peaks.get_legend().get_texts())
    plt.close(fig)
