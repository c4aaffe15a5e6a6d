"""Progress bars for every command: tqdm redrawing one line on a terminal; in a log (stderr not a
terminal: a batch job's log, a file, CI) a plain line every LOG_INTERVAL seconds instead of the
carriage returns a terminal would redraw over.

Privacy: a bar shows counts of work done (rows, users, epochs), never a value of the data."""

from __future__ import annotations

import sys

from tqdm import tqdm

LOG_INTERVAL = 30.0  # seconds between a log's progress lines


class _Lines:
    """A stream that writes each redraw of a bar as its own line."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip("\n")
        if line.strip():
            self._stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def bar(iterable=None, *, enabled: bool = True, mininterval: float = 0.1, **options) -> tqdm:
    """A tqdm bar on stderr (`enabled` False: none), redrawn in place on a terminal, a line every
    LOG_INTERVAL seconds (or `mininterval`, if longer) in a log."""
    stream = sys.stderr
    terminal = stream.isatty()
    return tqdm(
        iterable,
        file=stream if terminal else _Lines(stream),
        disable=not enabled,
        mininterval=mininterval if terminal else max(mininterval, LOG_INTERVAL),
        **options,
    )
