"""A wall-clock limit for in-process stages (parsing, chunking).

A document that does not crash but takes a hundred times longer than the rest
would hold ingest for hours while every dashboard says "healthy"; the limit
turns that stall into an ordinary, visible failure of that one document.
Implemented with SIGALRM, so it applies on the main thread (the CLI, a Dagster
in-process run); elsewhere the stage runs unlimited.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def wall_clock_limit(seconds: float, error: Exception) -> Iterator[None]:
    """Raise ``error`` inside the block if it runs longer than ``seconds``."""
    usable = (seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise error

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
