"""Peak memory of each phase of a run made in this process: the driver (this Python process) and
everything under it (Spark's JVM in local mode and its Python workers), sampled by a thread.

`sampled()` records (wall-clock time, the root's RSS, the rest of its process tree's RSS) every
`interval` seconds while the block runs; `phase_peaks` cuts that timeline at the run's phases, each
from its start (the manifest's `phase_started_at`, Run.record_seconds) for its wall time (`seconds`),
and returns each phase's peak. A peak shorter than the interval can fall between two samples.
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
def sampled(interval: float = 0.25, root: int | None = None):
    """Yield a list that fills with (time.time(), root KiB, its descendants' KiB) samples of `root`
    (default: this process) until the block ends; a sampler that fails raises at the block's end."""
    samples: list[tuple[float, int, int]] = []
    failed: list[BaseException] = []
    done = threading.Event()
    root = os.getpid() if root is None else root

    def sample() -> None:
        try:
            while not done.wait(interval):
                own = memory_kib(root)[0]
                others = sum(memory_kib(pid)[0] for pid in descendants(root))
                samples.append((time.time(), own, others))
        except BaseException as error:  # reported by the block, not lost with the thread
            failed.append(error)

    thread = threading.Thread(target=sample, name="phase-memory", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()
    if failed:
        raise RuntimeError("the memory sampler failed") from failed[0]


def phase_peaks(
    samples: list[tuple[float, int, int]], started_at: dict[str, float], seconds: dict[str, float]
) -> dict[str, dict[str, float]]:
    """{phase: {"driver_mib", "all_mib"}}: the largest driver RSS and driver + tree RSS among the
    samples inside each phase, [its start, its start + its seconds); a phase no sample fell in is
    left out."""
    peaks = {}
    for phase, start in started_at.items():
        end = start + seconds.get(phase, 0.0)
        inside = [(driver, driver + others) for at, driver, others in samples if start <= at < end]
        if inside:
            peaks[phase] = {
                "driver_mib": max(d for d, _ in inside) / 1024,
                "all_mib": max(a for _, a in inside) / 1024,
            }
    return peaks
