"""bench.phase_memory: the timeline cut at the phases by hand, and a real process tree's memory seen
(the phases' starts a real run records: tests/pipelines/training/test_stages.py)."""

import subprocess
import sys
import time

import pytest

from bench import phase_memory


def test_each_phase_gets_the_peaks_of_the_samples_inside_it():
    mib = 1024
    samples = [(100.1, 100 * mib, 50 * mib), (100.6, 300 * mib, 0), (101.2, 200 * mib, 400 * mib), (103, 9 * mib, 0)]
    started_at = {  # as a manifest holds them: sorted by name, not in the order they ran
        "evaluation": 102.5,
        "prepare": 100.0,
        "step-1/stats": 100.5,
        "step-1/user_update": 200.0,  # a phase no sample fell in
    }
    seconds = {"evaluation": 0.5, "prepare": 0.5, "step-1/stats": 1.0, "step-1/user_update": 1.0}
    assert phase_memory.phase_peaks(samples, started_at, seconds) == {
        "prepare": {"driver_mib": 100, "all_mib": 150},
        "step-1/stats": {"driver_mib": 300, "all_mib": 600},  # driver and tree peak at different samples
    }  # 103 s is past the evaluation's end (102.5 + 0.5)


def test_the_sampler_sees_a_roots_child_and_stops_with_the_block():
    allocate = "import time; block = bytearray(300 << 20); block[::4096] = b'x' * len(block[::4096]); time.sleep(2)"
    shell = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "{allocate}"; sleep 0.5'])  # python under bash
    with phase_memory.sampled(interval=0.05, root=shell.pid) as samples:
        shell.wait()
    count = len(samples)
    assert count > 10 and [at for at, _, _ in samples] == sorted(at for at, _, _ in samples)
    assert max(others for _, _, others in samples) / 1024 == pytest.approx(300, abs=60)  # the python child alone
    assert 0 < max(own for _, own, _ in samples) / 1024 < 50  # bash
    time.sleep(0.3)
    assert len(samples) == count  # the thread stopped with the block
