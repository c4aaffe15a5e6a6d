"""The scaling benchmark: phases and kernels from a run's manifest, time to the common RMSE, the
growth fit, and the report from hand-made cells (the end-to-end run is a slow case)."""

import os

import pytest

from bench import harness, scale, training


def test_phases_sum_outer_steps_and_kernels_divide_spark_task_seconds_by_parallelism():
    manifest = {
        "seconds": {
            "prepare": 10.0,
            "step-1/user_update": 4.0,
            "step-2/user_update": 6.0,
            "step-1/stats": 8.0,
            "step-2/stats": 2.0,
            "step-1/item_update": 3.0,
            "step-2/item_update": 5.0,
            "final_user_update": 7.0,
            "evaluation": 1.0,
        },
        "kernel_seconds": {
            "step-1/user_update": 2.0,
            "step-2/user_update": 4.0,
            "step-1/stats": 6.0,
            "step-2/stats": 2.0,
            "step-1/item_update": 1.5,
            "step-2/item_update": 2.5,
            "final_user_update": 99.0,
        },
    }
    walls, kernels = scale.phase_seconds(manifest, parallelism=2)
    assert walls == {
        "prepare": 10.0,
        "user_update": 10.0,
        "stats": 10.0,
        "item_update": 8.0,
        "final_user_update": 7.0,
        "evaluation": 1.0,
    }
    assert kernels == {
        "user_update": 3.0,
        "stats": 4.0,
        "item_update": 4.0,
    }  # (2 + 4) / 2, (6 + 2) / 2, 1.5 + 2.5; the final update's is not an outer step's
    cell = {"seconds": walls, "kernel_seconds": kernels}
    assert scale.outside_share(cell) == pytest.approx(1 - 11.0 / 28.0)


def _cell(rows, test, times, tests, walls, kernels=None):
    return {
        "rows": rows,
        "items": 100,
        "test": test,
        "outer_steps": len(times) - 1,
        "trajectory": [{"step": s, "seconds": t, "test": v} for s, (t, v) in enumerate(zip(times, tests, strict=True))],
        "seconds": {**dict.fromkeys(scale.PHASES, 1.0), **walls},
        "kernel_seconds": kernels or dict.fromkeys(scale.KERNELS, 0.5),
    }


def test_time_to_the_worse_final_rmse_and_the_ratio():
    by_size = {
        1000: {
            "ssp": _cell(2e4, 0.90, [5, 10, 20], [1.0, 0.92, 0.90], {}),
            "dpsgd": _cell(2e4, 0.95, [5, 100, 300], [1.0, 0.97, 0.95], {}),
        }
    }
    summary = scale.summarize(by_size)
    # target 0.95 (AM-DPSGD's final); AM-SSP reaches it at its first step (10 s), AM-DPSGD at its last (300 s)
    assert summary[1000] == {"target": 0.95, "times": {"ssp": 10.0, "dpsgd": 300.0}, "ratio": 30.0}
    assert scale.summarize({1000: {"ssp": by_size[1000]["ssp"]}}) == {}  # one method alone: nothing to compare


def test_at_the_ranking_shape_the_worse_final_is_the_lower_recall():
    by_size = {
        136_677: {
            "ssp": _cell(2e7, 0.30, [40, 60, 90], [0.20, 0.28, 0.30], {}),
            "dpsgd": _cell(2e7, 0.25, [40, 400, 800], [0.20, 0.22, 0.25], {}),
        }
    }
    # target 0.25 (AM-DPSGD's final, the lower Recall@20); AM-SSP is above it at its first step (60 s)
    assert scale.summarize(by_size)[136_677] == {
        "target": 0.25,
        "times": {"ssp": 60.0, "dpsgd": 800.0},
        "ratio": 800 / 60,
    }


def test_growth_is_the_log_log_slope_of_the_outer_steps_time_against_rows():
    steps = {p: 1.0 for p in scale.KERNELS}
    by_size = {
        10: {"ssp": _cell(1e3, 1, [0, 1], [1, 1], {p: 1.0 for p in scale.KERNELS})},
        100: {"ssp": _cell(1e4, 1, [0, 1], [1, 1], {p: 10.0 for p in scale.KERNELS})},
        1000: {"ssp": _cell(1e5, 1, [0, 1], [1, 1], {p: 100.0 for p in scale.KERNELS})},
    }
    assert scale.rows_growth(by_size, "ssp") == pytest.approx(1.0)
    by_size[1000]["ssp"]["seconds"].update({p: 1000.0 for p in steps})
    assert scale.rows_growth(by_size, "ssp") > 1.2
    assert scale.rows_growth(by_size, "dpsgd") is None


def test_each_method_runs_its_own_item_update():
    configs = {
        params["method"]: params["config"] for params in scale.cells(quick=False) if not scale.is_shape(params["users"])
    }
    # AM-DPSGD with the best trial of its tuning at 10^5 users (bench/results/dpsgd-tune-100k): batch 256, one epoch
    assert configs["ssp"]["item_update"] == "ssp" and configs["dpsgd"]["item_update"] == "dpsgd"
    assert (configs["dpsgd"]["dpsgd_batch_size"], configs["dpsgd"]["dpsgd_epochs"]) == (256, 1)


def test_the_largest_size_runs_am_ssp_alone():
    by_size = {}
    for params in scale.cells(quick=False):
        by_size.setdefault(params["users"], []).append(params["method"])
    assert by_size == {
        10_000: list(scale.METHODS),
        100_000: list(scale.METHODS),
        1_000_000: list(scale.METHODS),
        10_000_000: ["ssp"],
        69_878: list(scale.METHODS),  # the MovieLens-10M shape
        136_677: ["ssp", "dpsgd", "none"],  # the MovieLens-20M shape, ranked: no DP per-item mean
    }
    shape = [params for params in scale.cells(quick=False) if params["users"] == 69_878]
    assert {(params["items"], params["ratings_per_user"]) for params in shape} == {(10_677, 143)}
    assert all("protocol" not in params for params in shape)  # the stored MovieLens-10M cells keep their keys
    ranking = [params for params in scale.cells(quick=False) if params["users"] == 136_677]
    assert {(params["items"], params["ratings_per_user"], params["protocol"]) for params in ranking} == {
        (20_108, 144, "recall")
    }
    # the MovieLens-10M shape: every method at its defaults (its tuning chose them); the ranking shape: the
    # settings its tuning chose
    assert all(params["config"] == training.METHODS[params["method"]].overrides for params in shape)
    assert all(
        params["config"]
        == {**training.METHODS[params["method"]].overrides, **scale.TUNED_RANKING_SHAPE[params["method"]]}
        for params in ranking
    )
    assert {params["config"].get("dpsgd_epochs") for params in ranking if params["method"] == "dpsgd"} == {1}
    assert scale.protocol_of(136_677) == "recall" and scale.protocol_of(69_878) == scale.protocol_of(10_000) == "rmse"
    grid = [params for params in scale.cells(quick=False) if not scale.is_shape(params["users"])]
    assert all("items" not in params for params in grid)  # the grid's cells keep their keys (the stored results)
    assert [params["users"] for params in scale.ladder_cells(quick=False)] == [10_000, 100_000, 1_000_000]


def test_the_report_from_stored_cells(tmp_path):
    results = harness.Results(str(tmp_path))
    finals = {
        "ssp": {300: 0.93, 1000: 0.9},
        "dpsgd": {300: 0.96, 1000: 0.95},
        "item-mean": {300: 1.0, 1000: 0.99},
        "none": {300: 1.02, 1000: 1.01},
    }
    for params in scale.cells(quick=True):
        fast = params["method"] == "ssp"
        final = finals[params["method"]][params["users"]]
        results.put(
            scale.NAME,
            params,
            _cell(
                params["users"] * 20,
                final,
                [5, 10, 20] if fast else [5, 500, 900],
                [1.0, 0.92, final] if fast else [1.0, 0.97, final],
                {"item_update": 3.0},
            ),
        )
    for params in scale.ladder_cells(quick=True):
        results.put(scale.NAME, params, {"item_mean": 0.98, "mf": 0.88})
    section = scale.run(harness.Context(str(tmp_path), True, 1, results, progress=False))
    text = section.markdown()
    assert "| 1,000 | RMSE 0.9500 | 10 | 900 | 90.0x |" in text and "meets the 30x goal" in text
    # the quality table: ladder lines, then the DP per-item mean, the starting point, AM-SSP, AM-DPSGD
    assert "| 1,000 | 0.9800 | 0.8800 | 0.9900 | 1.0100 | 0.9000 | 0.9500 |" in text
    assert "AM-SSP's test RMSE falls as the users grow: 0.9300 at 300 users, 0.9000 at 1,000" in text
    assert "-0.0800 from the non-private per-item mean and +0.0200 from biased MF" in text
    assert os.path.exists(tmp_path / "scale_time_vs_users.png") and os.path.exists(tmp_path / "scale_rmse_vs_time.png")


@pytest.mark.slow
def test_quick_scale_runs_the_real_pipeline(tmp_path):
    section = harness.run_experiment(scale.NAME, str(tmp_path), quick=True, seeds=1, progress=False)
    stored = harness.Results(str(tmp_path)).cells.values()
    assert sum(c["params"]["method"] in scale.METHODS for c in stored) == len(scale.METHODS) * len(scale.QUICK_USERS)
    assert all(0.5 < c["value"]["mf"] < c["value"]["item_mean"] for c in stored if c["params"]["method"] == "ladder")
    cells = [
        c["value"] for c in stored if c["params"]["method"] in scale.RACE
    ]  # the timed methods, each with its item update's kernel
    for cell in cells:
        phases = [p for p in scale.PHASES if p != "stats" or cell["seconds"]["stats"]]
        assert all(cell["seconds"][p] > 0 for p in phases) and all(
            cell["kernel_seconds"][p] > 0 for p in scale.KERNELS if p in phases
        )
        assert 0 < scale.outside_share(cell) < 1 and len(cell["trajectory"]) == cell["outer_steps"] + 1
    dpsgd = [c["value"] for c in harness.Results(str(tmp_path)).cells.values() if c["params"]["method"] == "dpsgd"]
    assert all(c["seconds"]["stats"] == 0 for c in dpsgd)  # AM-DPSGD releases no statistics: its item update is DP-SGD
    for cell in (
        c["value"] for c in stored if c["params"]["method"] == "ssp"
    ):  # what each phase read, wrote, computed and started
        assert all(cell["work"][p]["bytes"] > 0 for p in scale.PHASES) and all(
            cell["work"][p]["flops"] > 0 for p in scale.KERNELS
        )
        assert cell["spark_jobs"]["user_update"] >= 1 and cell["spark_jobs"]["item_update"] == 0
    assert (
        "ratio (AM-DPSGD / AM-SSP)" in section.markdown()
        and "Growth." in section.markdown()
        and "Each phase beside its limit" in section.markdown()
    )


def _memory(driver_peaks: dict[str, float]) -> dict:
    return {
        "driver_before_mib": 500.0,
        "phases": {phase: {"driver_mib": peak, "all_mib": peak + 1000} for phase, peak in driver_peaks.items()},
    }


def test_the_drivers_peak_is_judged_at_the_two_largest_sizes_of_the_grid():
    by_size = {
        10_000: {"ssp": {**_cell(2e5, 0.95, [1, 2], [1.0, 0.95], {}), "memory": _memory({"prepare": 9000.0})}},
        1_000_000: {"ssp": {**_cell(2e7, 0.92, [1, 2], [1.0, 0.92], {}), "memory": _memory({"prepare": 2500.0})}},
        10_000_000: {
            "ssp": {**_cell(2e8, 0.91, [1, 2], [1.0, 0.91], {}), "memory": _memory({"stats": 1500, "evaluation": 2800})}
        },
        69_878: {"ssp": {**_cell(1e7, 0.9, [1, 2], [1.0, 0.9], {}), "memory": _memory({"prepare": 9999.0})}},
    }
    verdict = scale.memory_verdict(by_size)  # 2,000 then 2,300 MiB above the 500 before: +15% (10^4, the shape aside)
    assert "2,000 MiB above its baseline at 1,000,000 users and 2,300 MiB at 10,000,000 (+15%): within" in verdict
    by_size[10_000_000]["ssp"]["memory"] = _memory({"evaluation": 3000.0})
    assert "(+25%): outside" in scale.memory_verdict(by_size)
    rows = scale.memory_rows(by_size)
    assert rows[-1][:4] == ["10,000,000", "AM-SSP", "500", "-"]  # no sample in prepare
    assert rows[-1][3 + scale.PHASES.index("evaluation")] == "3000 / 4000"
    assert "needs two sizes" in scale.memory_verdict({10_000: by_size[10_000]})
