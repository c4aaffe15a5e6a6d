"""bench.phase_memory: the timeline cut at the phases by hand, and a real grandchild's memory seen."""

import os
import subprocess
import sys

import pytest

from bench import phase_memory
from bench.child import memory_kib


def test_each_phase_gets_the_peaks_of_the_samples_inside_it():
    mib = 1024
    samples = [(0.1, 100 * mib, 50 * mib), (0.6, 300 * mib, 0), (1.2, 200 * mib, 400 * mib), (2.5, 900 * mib, 0)]
    peaks = phase_memory.phase_peaks(samples, {"prepare": 0.5, "step-1/stats": 1.0, "evaluation": 1.0})
    assert peaks == {
        "prepare": {"driver_mib": 100, "all_mib": 150},
        "step-1/stats": {"driver_mib": 300, "all_mib": 600},  # driver and tree peak at different samples
    }  # 2.5 s is past the last phase's end: "evaluation" holds no sample and is left out


def test_the_sampler_counts_a_grandchild_and_stops_with_the_block():
    allocate = "import time; block = bytearray(300 << 20); block[::4096] = b'x' * len(block[::4096]); time.sleep(2)"
    already = sum(memory_kib(pid)[0] for pid in phase_memory.descendants(os.getpid()))  # a test worker's JVM, ...
    with phase_memory.sampled(interval=0.05) as samples:
        subprocess.run(["bash", "-c", f'"{sys.executable}" -c "{allocate}"'], check=True)  # python under bash
    count = len(samples)
    assert count > 10 and all(driver > 0 for _, driver, _ in samples)
    assert (max(others for _, _, others in samples) - already) / 1024 == pytest.approx(300, abs=60)
    assert [at for at, _, _ in samples] == sorted(at for at, _, _ in samples)
    assert len(samples) == count  # the thread has stopped
