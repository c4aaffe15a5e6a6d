"""One run per run directory: a second run is refused while the first holds the lock (local and gs://)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pipelines.base.lock import LOCK_NAME, RunLockedError, run_lock
from schemas import storage


def test_second_run_is_refused_and_the_lock_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from pipelines.base.lock import run_lock
            with run_lock({str(tmp_path)!r}):
                print("locked", flush=True)
                time.sleep(60)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
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


def _hold(run_dir: str, lease_seconds: float) -> subprocess.Popen:
    """A process that takes the run lock and holds it until killed."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import time
            from pipelines.base.lock import run_lock
            with run_lock({run_dir!r}, lease_seconds={lease_seconds}):
                print("locked", flush=True)
                time.sleep(120)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_gs_lock_is_refused_while_renewed_and_taken_over_once_its_holder_died(gcs_path):
    lease = 2.0  # renewed every 0.67 s: ample on a loaded machine
    lock = storage.join(gcs_path, LOCK_NAME)
    holder = _hold(gcs_path, lease)
    try:
        time.sleep(1.5 * lease)  # past the first lease: the holder has renewed it
        with pytest.raises(RunLockedError, match="is in use by another run .* holds"):
            with run_lock(gcs_path, lease_seconds=lease):
                pass
        expires = storage.read_json(lock)["expires_at"]
    finally:
        holder.kill()
        holder.wait()
    assert storage.exists(lock)  # a killed holder leaves its lock object ...
    with pytest.raises(RunLockedError):
        with run_lock(gcs_path, lease_seconds=lease):
            pass
    time.sleep(max(0.0, expires - time.time()) + 0.1)  # ... which the next run takes over once the lease ran out
    with run_lock(gcs_path, lease_seconds=lease):
        assert storage.read_json(lock)["holder"].endswith(f"pid {os.getpid()}")
        with pytest.raises(RunLockedError):  # and the lock excludes within one process too
            with run_lock(gcs_path, lease_seconds=lease):
                pass
    assert not storage.exists(lock)  # released on exit


@pytest.fixture
def ctrl_c_interrupts():
    """SIGINT handled as Ctrl-C is (KeyboardInterrupt) while the test runs: a library an earlier test
    in the same worker started may have left another handler (the lock interrupts only through a
    callable one), which made the takeover test depend on the order xdist ran the tests in."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_gs_holder_whose_lock_was_taken_over_is_stopped(gcs_path, ctrl_c_interrupts):
    lease = 0.9
    lock = storage.join(gcs_path, LOCK_NAME)
    started = time.monotonic()
    with pytest.raises(RunLockedError, match="lost its lock .* taken over by elsewhere pid 1"):
        with run_lock(gcs_path, lease_seconds=lease):
            storage.write_json({"holder": "elsewhere pid 1", "token": "other", "expires_at": time.time() + 60}, lock)
            time.sleep(20 * lease)
    assert time.monotonic() - started < 5 * lease  # interrupted at its next renewal, not at the end of its work
    assert storage.read_json(lock)["token"] == "other"  # the other holder's lock is left alone
