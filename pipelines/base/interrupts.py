"""Ctrl-C that is not lost: inside `kept_interrupts()`, SIGINT raises KeyboardInterrupt as usual, and
again if that one was swallowed.

Python raises KeyboardInterrupt in whatever the main thread runs when SIGINT arrives. Inside a
finalizer or a weakref callback (py4j's cleanup of Java objects runs them during a Spark job's
gateway calls) the exception is printed as "Exception ignored ... Traceback" and dropped, and the
command would go on as if Ctrl-C had never been pressed (seen in tests/test_hostile_cli.py). Inside
the block:
- the handler arms a timer that sends SIGINT to the main thread again REDELIVER_S later, up to
  REDELIVERIES times, until an exception leaves the block (the interrupt, or what a caller made of
  it, such as the run lock's own error);
- a dropped KeyboardInterrupt is not printed (sys.unraisablehook): it is sent again;
- a block that ends normally with an interrupt still pending raises it as it ends.
So the command stops with its one line (pipelines.base.command) however the signal landed.

Privacy: reads no data and releases nothing.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

REDELIVER_S = 0.5  # seconds before a swallowed interrupt is sent again
REDELIVERIES = 5


@contextmanager
def kept_interrupts():
    """SIGINT -> KeyboardInterrupt inside the block, never lost (module docstring). Outside the main
    thread (no signal handlers there) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident
    lock = threading.Lock()
    pending = {"armed": False, "left": REDELIVERIES}

    def again() -> None:
        with lock:
            if pending["armed"] and pending["left"] > 0:
                pending["left"] -= 1
                signal.pthread_kill(main, signal.SIGINT)

    def interrupt(signum, frame):
        pending["armed"] = True
        timer = threading.Timer(REDELIVER_S, again)
        timer.daemon = True
        timer.start()
        raise KeyboardInterrupt

    hook = sys.unraisablehook

    def unraisable(info) -> None:
        if not isinstance(info.exc_value, KeyboardInterrupt):  # a swallowed Ctrl-C is sent again: nothing to print
            hook(info)

    previous = signal.signal(signal.SIGINT, interrupt)
    sys.unraisablehook = unraisable
    try:
        yield
    finally:  # whatever leaves the block stops the resending
        with lock:
            lost, pending["armed"] = pending["armed"], False
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook
    if lost:  # the block ended normally with an interrupt still pending
        raise KeyboardInterrupt
