"""One run at a time per run directory: an exclusive lock held for the whole run.

Two runs writing the same run directory at once would interleave their releases in one ledger
(and spend the budget twice over). The lock is an `fcntl.flock` on `RUN/.lock`: the second run is
refused at once with a clear error, and the operating system releases the lock when the holder
exits, even if it is killed, so a crashed run never blocks its own resume. Object stores have no
such lock: a `gs://` run directory relies on the scheduler running one run per directory (the
DAG does).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager

from schemas import storage


class RunLockedError(RuntimeError):
    """The run directory is in use by another run."""


@contextmanager
def run_lock(run_dir: str):
    """Hold the run directory's lock for the duration of the block (local paths only)."""
    fs, inner = storage.filesystem(run_dir)
    if not storage.is_local(fs):
        yield
        return
    os.makedirs(inner, exist_ok=True)
    handle = open(os.path.join(inner, ".lock"), "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockedError(f"{run_dir} is in use by another run (its lock {os.path.join(inner, '.lock')} is held); "
                                 "wait for it to finish, or use another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()
