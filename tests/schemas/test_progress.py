"""Progress bars: redrawn in place on a terminal, a plain line per update in a log."""

import io
import sys

from schemas import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_lines_without_carriage_returns_and_a_terminal_its_redraws(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)  # every update a line
    for _ in progress.bar(range(3), desc="work", unit="step"):
        pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) >= 2 and all(line.startswith("work:") for line in lines)
    assert "3/3" in lines[-1]
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    for _ in progress.bar(range(3), desc="work"):
        pass
    assert "\r" in terminal.getvalue()


def test_a_disabled_bar_writes_nothing_and_a_log_is_throttled(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    for _ in progress.bar(range(3), desc="quiet", enabled=False):
        pass
    assert log.getvalue() == ""
    for _ in progress.bar(range(1000), desc="many"):  # within LOG_INTERVAL: the first and the last line only
        pass
    assert len(log.getvalue().splitlines()) == 2
