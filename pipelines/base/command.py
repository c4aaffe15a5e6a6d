"""How a command runs: its -v/-q flags, and how it ends.

Bad input, bad settings and a machine that cannot take the output end with one line naming the
file or setting and exit status 2 (pipelines.base.errors decides which failures those are);
anything else is a bug and keeps its traceback. SIGTERM (a scheduler or `kill`) and Ctrl-C end
with one line too. The `ssp` command (ssp.cli) and the thin scripts spark-submit runs
(pipelines/user_update.py) end their commands here, so both behave the same.

Privacy: none of its own; stopping at any moment is safe because writes are atomic and a release
is recorded before it is computed (tests/test_kill_resume.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

from pipelines.base import errors
from pipelines.base.lock import RunLockedError
from schemas import storage

USER_ERRORS = (ValueError, storage.MissingTableError, RunLockedError)  # schema and ingest errors are ValueErrors


def add_verbosity(parser: argparse.ArgumentParser) -> None:
    """-v / -q: how much progress output (pipelines.base.logs) the command writes to stderr."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1, default=0,
                       help="also print the details: each privacy release's mechanism and the epsilon spent after it, a run's settings")
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1,
                       help="print only warnings and errors, no progress lines or bars (results still go to stdout)")


def _terminate_with_one_line(command: str):
    """The SIGTERM handler (a scheduler or `kill` stopping the command): one line, then leave at once,
    as a kill would. That is safe at any moment (writes are atomic, a release is recorded before it
    is computed, locks die with their holder, a killed run resumes: tests/test_kill_resume.py), where
    an exception raised from the handler can be swallowed by whatever it interrupts."""
    def terminate(signum, frame):  # the process's own stderr: a library may have redirected sys.stderr for a moment
        print(f"ssp {command}: terminated; nothing partial was published (run the same command again to resume)", file=sys.__stderr__, flush=True)
        sys.stdout.flush()
        os._exit(143)

    return terminate


def run(command: str, action: Callable[[], int], output: str | None = None) -> int:
    """Run `action()` as `ssp <command>`; its exit status. A user's error is one line on stderr and
    status 2 (`output`: the folder the command writes, named when the disk refuses it)."""
    previous = signal.signal(signal.SIGTERM, _terminate_with_one_line(command)) if threading.current_thread() is threading.main_thread() else None
    try:
        return action()
    except KeyboardInterrupt:
        print(f"ssp {command}: interrupted; nothing partial was published (run the same command again to resume)", file=sys.stderr)
        return 130
    except Exception as exc:
        message = errors.one_line(exc, USER_ERRORS, output=output)
        if message is None:
            raise  # a bug: its traceback is the report
        print(f"ssp {command}: error: {message}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
