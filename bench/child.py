"""Run a piece of Python in a fresh child interpreter and measure its own peak memory.

The child reports VmHWM from /proc/self/status, the peak of its own process image: getrusage's
ru_maxrss would also carry the peak of the parent it was forked from (Linux keeps it across exec),
so a large parent would inflate the figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_EPILOGUE = """
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) / 1024
print(json.dumps({**result, "peak_rss_mib": peak}))
"""


def run_measured(code: str, payload: dict) -> dict:
    """Run `code` (which reads `payload` from json.loads(sys.argv[1]) and sets a dict `result`) in
    a child; returns `result` plus `peak_rss_mib` and `wall_seconds`. Raises with the child's
    stderr tail if it fails."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", "import json, sys\n" + code + _EPILOGUE, json.dumps(payload)],
        capture_output=True,
        text=True,
        env=env,
    )
    if child.returncode != 0:
        raise RuntimeError(f"child exited with status {child.returncode}: {child.stderr[-3000:]}")
    return {**json.loads(child.stdout.strip().splitlines()[-1]), "wall_seconds": time.perf_counter() - started}


def processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, command name)} of every process now running."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    stat = handle.read()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            found[int(entry)] = (int(rest[1]), name)
    return found


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, (0, 0) once it is gone."""
    values = {"VmRSS:": 0, "VmHWM:": 0}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                key = line.split(maxsplit=1)[0]
                if key in values:
                    values[key] = int(line.split()[1])
    except OSError:
        pass
    return values["VmRSS:"], values["VmHWM:"]


def run_tree_measured(code: str, payload: dict, interval: float = 0.5) -> dict:
    """`run_measured`, and the memory of the child's whole process tree, sampled every `interval` s:
    the peak of the child itself (the driver), of any JVM under it (Spark's driver and executor in
    local mode) and of Python processes under a JVM (Spark's Python workers: the largest one, and
    the largest sum of those alive at one time), in MiB. A process's peak is its own VmHWM, so
    a peak between two samples still counts."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", "import json, sys\n" + code + _EPILOGUE, json.dumps(payload)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    peaks: dict[int, tuple[str, int]] = {}  # pid -> (kind, VmHWM KiB)
    workers_total = 0
    output: dict[str, str] = {}
    reader = threading.Thread(
        target=lambda: output.update(zip(("stdout", "stderr"), child.communicate(), strict=True)), daemon=True
    )
    reader.start()
    while reader.is_alive():
        table = processes()
        kinds = {child.pid: "driver"}
        changed = True  # a child may be listed before its parent: repeat until every descendant is classified
        while changed:
            changed = False
            for pid, (parent, name) in table.items():
                if pid in kinds or parent not in kinds:
                    continue
                kinds[pid] = (
                    "jvm" if name == "java" else ("worker" if kinds[parent] in ("jvm", "worker") else "driver-child")
                )
                changed = True
        alive_workers = 0
        for pid, kind in kinds.items():
            rss, hwm = memory_kib(pid)
            if hwm:
                peaks[pid] = (kind, max(hwm, peaks.get(pid, (kind, 0))[1]))
            if kind == "worker":
                alive_workers += rss
        workers_total = max(workers_total, alive_workers)
        reader.join(interval)
    if child.returncode != 0:
        raise RuntimeError(f"child exited with status {child.returncode}: {output.get('stderr', '')[-3000:]}")

    def peak(kind: str) -> float:
        return max([hwm for k, hwm in peaks.values() if k == kind], default=0) / 1024

    result = json.loads(output["stdout"].strip().splitlines()[-1])
    return {
        **result,
        "wall_seconds": time.perf_counter() - started,
        "driver_peak_mib": peak("driver"),
        "jvm_peak_mib": peak("jvm"),
        "worker_peak_mib": peak("worker"),
        "workers_peak_total_mib": workers_total / 1024,
    }
