"""How many provider requests a worker has in flight: an AIMD limit shared by its threads.

A claim thread takes a slot before it claims and gives it back when the claim's
requests are done, so no job waits under a lease for a slot. The limit starts
at the worker's concurrency; a failure that is the provider's (a 429, a 5xx or
timeout while it answers nobody) halves it (at most once per ``CUT_SPACING``
seconds: the failures of one round of requests cut it once), down to one
request; every usable answer raises it by ``1/limit`` (one request per round of
answers), back up to the concurrency. So while the provider fails broadly the
worker sends fewer requests at once, and as the errors clear it is back to full
concurrency within a few answers.
"""

from __future__ import annotations

import threading
import time

# Failures within this many seconds of a cut belong to the same round of requests: one cut.
CUT_SPACING = 1.0


class SendLimit:
    def __init__(self, ceiling: int) -> None:
        self.ceiling = max(1, ceiling)
        self._limit = float(self.ceiling)
        self._in_flight = 0
        self._last_cut = float("-inf")
        self._cond = threading.Condition()

    @property
    def limit(self) -> int:
        return int(self._limit)

    def acquire(self, stop_event: threading.Event, poll: float) -> bool:
        """Wait for a slot (False: the worker is stopping; no slot taken)."""
        with self._cond:
            while self._in_flight >= int(self._limit):
                if stop_event.is_set():
                    return False
                self._cond.wait(poll)
            if stop_event.is_set():
                return False
            self._in_flight += 1
            return True

    def release(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify()

    def answered(self) -> None:
        """A usable answer: one more request per round of answers, up to the ceiling."""
        with self._cond:
            before = int(self._limit)
            self._limit = min(float(self.ceiling), self._limit + 1.0 / self._limit)
            if int(self._limit) > before:
                self._cond.notify()

    def failed(self) -> None:
        """A failure of the provider's: halve the limit (once per round), at least one request."""
        now = time.monotonic()
        with self._cond:
            if now - self._last_cut >= CUT_SPACING:
                self._limit = max(1.0, self._limit / 2)
                self._last_cut = now
