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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), "TF_CPP_MIN_LOG_LEVEL": "2"}
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", "import json, sys\n" + code + _EPILOGUE, json.dumps(payload)],
                           capture_output=True, text=True, env=env)
    if child.returncode != 0:
        raise RuntimeError(f"child exited with status {child.returncode}: {child.stderr[-3000:]}")
    return {**json.loads(child.stdout.strip().splitlines()[-1]), "wall_seconds": time.perf_counter() - started}
