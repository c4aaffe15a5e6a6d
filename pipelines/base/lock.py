"""One run at a time per run directory: an exclusive lock held for the whole run (or stage).

Two runs writing the same run directory at once would interleave their releases in one ledger
(and spend the budget twice over). The second one is refused at once with a clear error, and a
holder that dies, however it dies, never blocks its own resume for long.

Local run directory: an `fcntl.flock` on `RUN/.lock`; the operating system releases it when the
holder exits, even if it is killed.

gs:// run directory (stages run on different machines): a lease, the object `RUN/.lock` naming its
holder and the time its lease expires. It is created only if absent (generation precondition 0);
the holder renews it every third of the lease (precondition: the generation it wrote last) and
deletes it when done. A lock whose lease has run out (its holder was killed, or lost its network
for a whole lease) is taken over under the precondition of the generation seen, so of two
contenders exactly one wins. Expiry compares the holder's clock with the contender's: the lease
(60 s) is long against the clock skew of NTP-synchronised machines. A holder that cannot renew
within its lease, or finds its lock taken over, has lost it: the main thread holding it is
interrupted (SIGINT, as Ctrl-C would), which surfaces as RunLockedError (a Spark job or TensorFlow call in flight
finishes that
call first; a lock held in another thread reports the loss when its block ends).
Each renewal also reads the lock back before writing, so a storage emulator that ignores
preconditions (gcp-storage-emulator) still shows a takeover; real GCS enforces them.

Privacy: the locks keep two runs or releases from writing one run directory, ledger or account at
once; they hold no data.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import threading
import time
import uuid
from contextlib import contextmanager

from schemas import storage
from schemas.errors import UserError

LOCK_NAME = ".lock"
LEASE_SECONDS = 60.0


class RunLockedError(RuntimeError):
    """The run directory is in use by another run (or this run lost its lock)."""


@contextmanager
def run_lock(run_dir: str, lease_seconds: float = LEASE_SECONDS):
    """Hold the run directory's lock for the duration of the block (local path or gs://)."""
    fs, inner = storage.filesystem(run_dir)
    if storage.is_local(fs):
        with _file_lock(run_dir, inner):
            yield
    elif run_dir.startswith("gs://"):
        with _lease(storage.join(run_dir.rstrip("/"), LOCK_NAME), run_dir, lease_seconds):
            yield
    else:
        raise UserError(f"{run_dir}: a run directory must be a local path or gs:// (no run lock for this filesystem)")


@contextmanager
def _file_lock(run_dir: str, inner: str):
    os.makedirs(inner, exist_ok=True)
    path = os.path.join(inner, LOCK_NAME)
    handle = open(path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockedError(
                f"{run_dir} is in use by another run (its lock {path} is held); wait for it to finish, or use "
                "another --out"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


class _Lease:
    """The lock object of a gs:// run directory, held and renewed by this process."""

    def __init__(self, url: str, run_dir: str, lease_seconds: float):
        from google.cloud import storage as gcs

        bucket, _, name = url[len("gs://") :].partition("/")
        self.blob = gcs.Client(project=None).bucket(bucket).blob(name)  # default credentials; objects need no project
        self.url, self.run_dir, self.lease_seconds = url, run_dir, lease_seconds
        self.holder = f"{socket.gethostname()} pid {os.getpid()}"
        self.token = uuid.uuid4().hex
        self.generation: int | None = None
        self.renewed_at = 0.0
        self.lost: str | None = None
        self.closing = False
        self.interrupts = (
            threading.current_thread() is threading.main_thread()
        )  # only the main thread can be interrupted
        self.mutex = threading.Lock()
        self.stopped = threading.Event()
        self.renewer = threading.Thread(target=self._renew_until_stopped, name=f"run lock {url}", daemon=True)

    def _read(self) -> tuple[int, dict] | None:
        """(generation, document) of the lock object, or None when there is none."""
        from google.api_core import exceptions

        blob = self.blob.bucket.get_blob(self.blob.name)
        if blob is None:
            return None
        try:
            document = json.loads(blob.download_as_bytes(if_generation_match=blob.generation))
        except (exceptions.NotFound, exceptions.PreconditionFailed):  # deleted or replaced since it was listed
            return None
        except ValueError:
            raise RunLockedError(
                f"{self.url} is not a run lock (not JSON); remove it if no run is using {self.run_dir}"
            ) from None
        return blob.generation, document

    def _write(self, if_generation_match: int) -> None:
        now = time.time()
        document = {"holder": self.holder, "token": self.token, "expires_at": now + self.lease_seconds}
        self.blob.upload_from_string(
            json.dumps(document), content_type="application/json", if_generation_match=if_generation_match
        )
        self.generation, self.renewed_at = self.blob.generation, time.monotonic()

    def acquire(self) -> None:
        from google.api_core import exceptions

        for _ in range(3):  # a precondition lost to another contender: look again
            current = self._read()
            if current is not None and current[1].get("expires_at", 0) > time.time():
                document = current[1]
                raise RunLockedError(
                    f"{self.run_dir} is in use by another run ({document.get('holder')} holds {self.url} until "
                    f"{time.strftime('%H:%M:%S', time.localtime(document['expires_at']))}, renewing it while it runs); "
                    "wait for it to finish, or use another --out"
                )
            try:
                self._write(if_generation_match=0 if current is None else current[0])
            except exceptions.PreconditionFailed:
                continue
            self.renewer.start()
            return
        raise RunLockedError(f"{self.run_dir}: other processes are taking its lock {self.url}; use another --out")

    def _renew_until_stopped(self) -> None:
        from google.api_core import exceptions

        while not self.stopped.wait(self.lease_seconds / 3):
            try:
                current = self._read()
                if current is None or current[1].get("token") != self.token:
                    self._lose(
                        f"{self.url} was taken over by {current[1].get('holder')}"
                        if current
                        else f"{self.url} was replaced or deleted"
                    )
                    return
                self._write(if_generation_match=self.generation)
            except exceptions.PreconditionFailed:
                self._lose(f"{self.url} was taken over by another process")
                return
            except Exception as exc:  # a network error: retried at the next renewal while the lease lasts
                if time.monotonic() - self.renewed_at > self.lease_seconds:
                    self._lose(f"{self.url} could not be renewed within its {self.lease_seconds:g} s lease ({exc})")
                    return

    def _lose(self, reason: str) -> None:
        with self.mutex:
            self.lost = reason
            if self.interrupts and not self.closing and callable(signal.getsignal(signal.SIGINT)):
                signal.pthread_kill(
                    threading.main_thread().ident, signal.SIGINT
                )  # a real signal: it also ends a sleep or a wait

    def close(self) -> None:
        """Stop renewing (after this, a loss no longer interrupts the main thread)."""
        with self.mutex:
            self.closing = True
        self.stopped.set()
        if self.renewer.is_alive():
            self.renewer.join()

    def release(self) -> None:
        """Delete the lock object if it is still this process's."""
        from google.api_core import exceptions

        if self.lost is None and self.generation is not None:
            try:
                self.blob.delete(if_generation_match=self.generation)
            except (exceptions.NotFound, exceptions.PreconditionFailed):
                pass


@contextmanager
def _lease(url: str, run_dir: str, lease_seconds: float):
    lease = _Lease(url, run_dir, lease_seconds)
    lease.acquire()
    try:
        yield
        lease.close()
    except KeyboardInterrupt:
        lease.close()
        if lease.lost:
            raise RunLockedError(
                f"{run_dir}: this run lost its lock ({lease.lost}); another run may be using the directory"
            ) from None
        raise
    except BaseException:
        lease.close()
        raise
    finally:
        lease.release()
    if lease.lost:  # found out while closing: the block's work is done, but another run may have written meanwhile
        raise RunLockedError(
            f"{run_dir}: this run lost its lock ({lease.lost}); another run may have used the directory meanwhile"
        )


RELEASE_LOCK_WAIT = 120.0  # seconds a release waits for another one on the same ledger


@contextmanager
def release_lock(path: str, wait_seconds: float = RELEASE_LOCK_WAIT):
    """Hold the lock of one ledger (or budget account) at `path` while a release is bound,
    recorded and charged: a short critical section that concurrent releases wait for (up to
    `wait_seconds`) instead of being refused. Locally an `fcntl.flock` on `<path>.lock`; on gs://
    the lease object `<path>.lock` (see run_lock), taken when free."""
    fs, inner = storage.filesystem(path)
    deadline = time.monotonic() + wait_seconds
    if storage.is_local(fs):
        os.makedirs(os.path.dirname(os.path.abspath(inner)), exist_ok=True)
        with os.fdopen(os.open(f"{inner}.lock", os.O_RDWR | os.O_CREAT, 0o600), "r+") as handle:  # owner's alone
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RunLockedError(
                            f"{path} is being written by another release for over {wait_seconds:g} s; try again later"
                        ) from None
                    time.sleep(0.05)
            yield
        return
    if not path.startswith("gs://"):
        raise UserError(f"{path}: a ledger must be on a local path or gs:// (no release lock for this filesystem)")
    while True:
        lease = _Lease(f"{path}.lock", path, LEASE_SECONDS)
        try:
            lease.acquire()
            break
        except RunLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    try:
        yield
    finally:
        lease.close()
        lease.release()
