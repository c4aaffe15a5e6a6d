"""One run per run directory: a second run is refused while the first holds the lock."""

import subprocess
import sys
import textwrap

import pytest

from pipelines.lock import RunLockedError, run_lock


def test_second_run_is_refused_and_the_lock_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pipelines.lock import run_lock
            with run_lock({str(tmp_path)!r}):
                print("locked", flush=True)
                time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match="is in use by another run"):
            with run_lock(str(tmp_path)):
                pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock(str(tmp_path)):  # a killed holder leaves no stale lock
        with pytest.raises(RunLockedError):
            with run_lock(str(tmp_path)):  # and the lock excludes within one process too
                pass
