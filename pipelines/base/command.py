"""How a command runs: its -v/-q flags, and how it ends.

Bad input, bad settings and a machine that cannot take the output end with one line naming the
file or setting and exit status 2 (pipelines.base.failures decides which failures those are);
anything else is a bug: one line that says so and where its traceback went (or the traceback
itself, with -v), exit status 3. SIGTERM (a scheduler or `kill`) and Ctrl-C end
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
import traceback
from collections.abc import Callable

import pyarrow as pa

from pipelines.base import failures, logs
from pipelines.base.lock import RunLockedError
from schemas import storage
from schemas.errors import UserError

USER_ERRORS = (
    UserError,
    storage.MissingTableError,
    RunLockedError,
    pa.ArrowInvalid,
)  # the project's refusals; a table Arrow cannot parse
BUG_STATUS = 3  # a bug's exit status: distinct from a refusal's 2, Ctrl-C's 130 and SIGTERM's 143


def add_verbosity(parser: argparse.ArgumentParser) -> None:
    """-v / -q: how much progress output (pipelines.base.logs) the command writes to stderr."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "-v",
        "--verbose",
        dest="verbosity",
        action="store_const",
        const=1,
        default=0,
        help="also print the details: each privacy release's mechanism and the epsilon spent after it, a run's "
        "settings",
    )
    group.add_argument(
        "-q",
        "--quiet",
        dest="verbosity",
        action="store_const",
        const=-1,
        help="print only warnings and errors, no progress lines or bars (results still go to stdout)",
    )


class _LineStart:
    """The command's stderr, remembering whether what was last written ended its line: a progress
    bar leaves the cursor mid-line while it draws, and a command's final line must start a line."""

    def __init__(self, stream):
        self.stream, self.at_line_start = stream, True

    def write(self, text: str) -> int:
        if text:
            self.at_line_start = text.endswith("\n")
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _final(line: str, close_bars: bool = True) -> str:
    """`line` as a command's last words: on a line of its own, even after an unfinished progress bar.
    The bars still open are closed first (left as drawn), so that none is drawn again after it;
    not from a signal handler (`close_bars` False), which leaves at once."""
    if close_bars:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    return line if not isinstance(sys.stderr, _LineStart) or sys.stderr.at_line_start else "\n" + line


def _terminate_with_one_line(command: str):
    """The SIGTERM handler (a scheduler or `kill` stopping the command): one line, then leave at once,
    as a kill would. That is safe at any moment (writes are atomic, a release is recorded before it
    is computed, locks die with their holder, a killed run resumes: tests/test_kill_resume.py), where
    an exception raised from the handler can be swallowed by whatever it interrupts."""

    def terminate(signum, frame):  # the process's own stderr: a library may have redirected sys.stderr for a moment
        print(
            _final(
                f"ssp {command}: terminated; nothing partial was published (run the same command again to resume)",
                close_bars=False,
            ),
            file=sys.__stderr__,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(143)

    return terminate


def _bug_line(command: str, exc: Exception) -> str:
    """A bug's one line: what failed and where its traceback is (printed above it with -v, else saved to a file)."""
    trace = "".join(traceback.format_exception(exc))
    if logs.verbose():
        sys.stderr.write(trace)
        where = "its traceback is above"
    else:
        where = f"its traceback is in {failures.save_trace([trace])} (-v prints it)"
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return (
        f"ssp {command}: internal error (a bug, not a problem with the input): "
        f"{type(exc).__name__}{': ' + first if first else ''}; {where}"
    )


def run(command: str, action: Callable[[], int], output: str | None = None) -> int:
    """Run `action()` as `ssp <command>`; its exit status. A user's error is one line on stderr and
    status 2 (`output`: the folder the command writes, named when the disk refuses it); a bug one
    line saying so and where its traceback is, status 3."""
    previous = (
        signal.signal(signal.SIGTERM, _terminate_with_one_line(command))
        if threading.current_thread() is threading.main_thread()
        else None
    )
    stderr = sys.stderr
    sys.stderr = stderr if isinstance(stderr, _LineStart) else _LineStart(stderr)
    try:
        return action()
    except KeyboardInterrupt:
        print(
            _final(f"ssp {command}: interrupted; nothing partial was published (run the same command again to resume)"),
            file=sys.stderr,
        )
        return 130
    except Exception as exc:
        message = failures.one_line(exc, USER_ERRORS, output=output)
        if message is None:
            print(_final(_bug_line(command, exc)), file=sys.stderr)
            return BUG_STATUS
        print(_final(f"ssp {command}: error: {message}"), file=sys.stderr)
        return 2
    finally:
        sys.stderr = stderr
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
