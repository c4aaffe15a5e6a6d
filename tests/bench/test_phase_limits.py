"""Each phase beside its limit: the larger of its I/O and arithmetic bounds, plus its Spark jobs'
fixed cost (bench.phase_limits)."""

from bench import phase_limits

RATES = {"gemm_flops": 1e10, "read_bytes_per_s": 1e8, "job_seconds": 0.5}


def _cell():
    work = {phase: {"bytes": 0.0, "flops": 0.0} for phase in phase_limits.PHASES}
    work["prepare"] = {"bytes": 2e8, "flops": 0.0}  # I/O: 2 s
    work["user_update"] = {"bytes": 1e8, "flops": 3e10}  # arithmetic: 3 s beats 1 s of I/O
    work["item_update"] = {"bytes": 5e7, "flops": 1e9}  # I/O: 0.5 s beats 0.1 s
    seconds = dict.fromkeys(phase_limits.PHASES, 1.0) | {"prepare": 8.0, "user_update": 8.0, "item_update": 2.0}
    return {"work": work, "spark_jobs": {"prepare": 4, "user_update": 2}, "seconds": seconds}


def test_a_phase_limit_is_its_larger_bound_plus_its_jobs():
    assert phase_limits.limits(_cell(), RATES) == {
        "prepare": 4.0,
        "user_update": 4.0,
        "stats": 0.0,
        "item_update": 0.5,
        "final_user_update": 0.0,
        "evaluation": 0.0,
    }


def test_the_rows_give_wall_over_limit_and_the_whole_run():
    rows = phase_limits.rows(_cell(), RATES)
    assert rows[0] == ["prepare", "8.0", "200", "0.0", "4", "4.0", "2.0x"]
    assert rows[1] == ["user_update", "8.0", "100", "30.0", "2", "4.0", "2.0x"]
    assert rows[3][-1] == "4.0x" and rows[2][-1] == "-"  # item update 2 s against 0.5; the stats did nothing
    assert rows[-1] == ["whole run", "21.0", "", "", "6", "8.5", "2.5x"]
