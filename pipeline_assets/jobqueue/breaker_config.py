"""The bounds of a model's shared circuit breaker (``JobStore.record_failure``: the stores and
``jobqueue.transitions``)."""

from __future__ import annotations

# Consecutive provider failures (5xx, timeouts, connection errors) that trip the shared circuit
# breaker; a 429 trips it at once.
BREAKER_THRESHOLD = 5
# The longest the breaker pauses between probes when the provider gave no Retry-After, however long
# it has been failing: once it is back, the next probe reaches it within this (plus a poll), not
# after a minute's backoff.
BREAKER_PROBE_INTERVAL = 5.0
