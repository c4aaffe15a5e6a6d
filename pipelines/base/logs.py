"""The jobs' progress output, through `logging` (the "ssp" logger, on stderr), and its verbosity.

Default: progress lines and progress bars. `-q`: warnings and errors only, no bars (the commands'
results still go to stdout). `-v`: also the details: each release's parameters, the settings a run
starts with. Library callers get the default without configuring anything.

Privacy: output for the operator on the trusted side, not a release.
"""

from __future__ import annotations

import contextlib
import logging
import sys

LOGGER = logging.getLogger("ssp")


class _Stderr(logging.StreamHandler):
    """A handler that writes to whatever `sys.stderr` is at the time (as logging's last resort does)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


if not LOGGER.handlers:
    LOGGER.addHandler(_Stderr())
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


class _BeamBigQueryNote(logging.Filter):
    """Beam's first import logs on the root logger that its optional BigQuery client (apitools) is
    missing: this project reads no BigQuery, so the line only alarms (every Beam run printed it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and record.getMessage().startswith("apitools not found"))


if not any(isinstance(f, _BeamBigQueryNote) for f in logging.getLogger().filters):
    logging.getLogger().addFilter(_BeamBigQueryNote())


def configure(verbosity: int) -> None:
    """-1 (`-q`): warnings only; 0: progress; 1 or more (`-v`): details too. gcsfs logs a traceback
    at every retry of a gs:// request, and py4j its connections' teardown after Ctrl-C: shown with -v only
    (the command's error line names the cause). py4j's debug level, every command sent to the JVM
    and its answer (thousands of lines a run), stays off even with -v."""
    LOGGER.setLevel(logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO)
    logging.getLogger("gcsfs").setLevel(logging.DEBUG if verbosity > 0 else logging.CRITICAL)
    logging.getLogger("py4j").setLevel(
        logging.INFO if verbosity > 0 else logging.CRITICAL
    )  # its gateway's teardown traces after Ctrl-C


@contextlib.contextmanager
def progress_hidden():
    """Progress lines hidden inside (warnings shown; with -v, everything): work nested in a command
    that reports its own progress."""
    level = LOGGER.level
    if level == logging.INFO:
        LOGGER.setLevel(logging.WARNING)
    try:
        yield
    finally:
        LOGGER.setLevel(level)


def log(message: str) -> None:
    """A progress line (hidden by -q)."""
    LOGGER.info(message)


def warn(message: str) -> None:
    """A warning (shown even with -q)."""
    LOGGER.warning(f"warning: {message}")


def detail(message: str) -> None:
    """A detail line (shown by -v)."""
    LOGGER.debug(message)


def verbose() -> bool:
    """Whether detail lines show (-v)."""
    return LOGGER.isEnabledFor(logging.DEBUG)


def bars(progress: bool = True) -> bool:
    """Whether a progress bar shows: the caller asked for one and the verbosity allows it."""
    return progress and LOGGER.isEnabledFor(logging.INFO)
