"""Ctrl-C is not lost when a finalizer swallows it (pipelines.base.interrupts): the case py4j's
cleanup of Java objects makes during a Spark job's gateway calls."""

import os
import signal
import sys
import time
import weakref

import pytest

from pipelines.base import interrupts


class _Thing:
    pass


def _interrupted_inside_a_finalizer() -> None:
    """SIGINT arrives while a weakref finalizer runs: Python raises KeyboardInterrupt there, and drops it."""
    thing = _Thing()
    weakref.finalize(thing, os.kill, os.getpid(), signal.SIGINT)
    del thing  # the finalizer runs now (reference counting)


def test_without_the_block_a_finalizer_swallows_ctrl_c(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: seen.append(type(info.exc_value)))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_inside_a_finalizer()
        time.sleep(0.2)  # nothing interrupts this: the KeyboardInterrupt was dropped
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [KeyboardInterrupt]


def test_inside_the_block_a_swallowed_ctrl_c_is_raised_again_and_not_printed(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: seen.append(type(info.exc_value)))
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with interrupts.kept_interrupts():
            _interrupted_inside_a_finalizer()
            time.sleep(30)  # ended by the interrupt sent again
    assert time.monotonic() - started < 10 and seen == []
    assert sys.unraisablehook is not None and signal.getsignal(signal.SIGINT) is not None


def test_a_block_that_ends_with_ctrl_c_pending_raises_it_as_it_ends():
    with pytest.raises(KeyboardInterrupt):
        with interrupts.kept_interrupts():
            _interrupted_inside_a_finalizer()  # the block ends before the interrupt is sent again


def test_an_interrupt_that_leaves_the_block_is_not_sent_again():
    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with interrupts.kept_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
    assert signal.getsignal(signal.SIGINT) is previous
    time.sleep(interrupts.REDELIVER_S * 2)  # no second KeyboardInterrupt arrives here


def test_what_a_caller_makes_of_the_interrupt_stops_the_resending():
    with pytest.raises(RuntimeError, match="lost the lock"):
        with interrupts.kept_interrupts():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
            except KeyboardInterrupt:
                raise RuntimeError("lost the lock") from None  # as the run lock turns its interrupt into its own error
    time.sleep(interrupts.REDELIVER_S * 2)
