"""Peak memory of each phase of a run made in this process: the driver (this Python process) and
everything under it (Spark's JVM in local mode and its Python workers), sampled by a thread.

`sampled()` records (seconds since its start, driver RSS, the rest of the process tree's RSS) every
`interval` seconds while the block runs; `phase_peaks` cuts that timeline at the run's phases, which
follow each other in the order the manifest recorded their wall times (`Run.record_seconds`), and
returns each phase's peak. A peak shorter than the interval can fall between two samples.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

from bench.child import memory_kib, processes


def descendants(root: int) -> list[int]:
    """The pids of every process under `root` (its children, theirs, ...)."""
    table = processes()
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, (parent, _) in table.items() if parent in frontier}
        found += sorted(frontier)
    return found


@contextmanager
def sampled(interval: float = 0.25):
    """Yield a list that fills with (seconds, driver KiB, others KiB) samples until the block ends."""
    samples: list[tuple[float, int, int]] = []
    done = threading.Event()
    started, me = time.perf_counter(), os.getpid()

    def sample() -> None:
        while not done.wait(interval):
            driver = memory_kib(me)[0]
            others = sum(memory_kib(pid)[0] for pid in descendants(me))
            samples.append((time.perf_counter() - started, driver, others))

    thread = threading.Thread(target=sample, name="phase-memory", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()


def phase_peaks(samples: list[tuple[float, int, int]], seconds: dict[str, float]) -> dict[str, dict[str, float]]:
    """{phase: {"driver_mib", "all_mib"}}: the largest driver RSS and driver + tree RSS among the
    samples inside each phase, the phases laid end to end from the first sample's start in the
    order of `seconds` (the manifest's {phase: wall seconds}); a phase no sample fell in is left out."""
    peaks, start = {}, 0.0
    for phase, length in seconds.items():
        inside = [(driver, driver + others) for at, driver, others in samples if start <= at < start + length]
        if inside:
            peaks[phase] = {
                "driver_mib": max(d for d, _ in inside) / 1024,
                "all_mib": max(a for _, a in inside) / 1024,
            }
        start += length
    return peaks
