"""What the worker's recent requests say about the provider: how many failures a job may
meet before they are evidence against its inputs rather than bad luck.

``ProviderRates`` keeps the outcomes of the worker's last ``WINDOW`` requests (every request,
a poison input's and the trivial checks' too; no clock, no I/O) and estimates the rate ``p``
of transient faults (throttles apart) with ``PRIOR_SUCCESSES``/``PRIOR_FAULTS`` pseudo-counts,
so a new worker starts from p = 1/3. A job's failures point at its inputs when that many in a
row would happen by chance with probability at most ``CHANCE``:
``k = ceil(log CHANCE / log p)``, bounded to [``MIN_EVIDENCE_FAULTS``, ``MAX_EVIDENCE_FAULTS``]
(throttles: [``request_plan.THROTTLE_SHRINK_AFTER``, ``MAX_EVIDENCE_THROTTLES``]). A healthy
provider gives 2, 30% failing 4, 60% the upper bound 8, which bounds a poison input's sends
whatever the provider does.
"""

from __future__ import annotations

import math
import threading
from collections import deque

# Outcomes of recent requests kept to estimate the provider's failure rates.
WINDOW = 50
# Pseudo-outcomes added to the window (p = 1/3 before any request).
PRIOR_SUCCESSES = 4
PRIOR_FAULTS = 2
# Failures in a row that would happen by chance at most this often count as evidence against inputs.
CHANCE = 0.01
# Bounds on the faults (5xx, timeouts, dropped or unusable answers) that must be met before a
# job's requests shrink; the upper one bounds a poison input's sends (docs/state-machine.md).
MIN_EVIDENCE_FAULTS = 1
MAX_EVIDENCE_FAULTS = 8
# The same for throttles (the lower bound is request_plan.THROTTLE_SHRINK_AFTER).
MAX_EVIDENCE_THROTTLES = 12

SUCCESS, FAULT, THROTTLE = "success", "fault", "throttle"


def evidence_threshold(p: float, low: int, high: int) -> int:
    """Failures in a row that happen by chance at most ``CHANCE`` of the time at a failure rate ``p``."""
    if p <= 0.0:
        return low
    if p >= 1.0:
        return high
    return max(low, min(high, math.ceil(math.log(CHANCE) / math.log(p) - 1e-9)))


class ProviderRates:
    """The outcomes of a worker's recent requests, shared by its threads."""

    def __init__(self) -> None:
        self._outcomes: deque[str] = deque(maxlen=WINDOW)
        self._lock = threading.Lock()

    def record(self, outcome: str) -> None:
        with self._lock:
            self._outcomes.append(outcome)

    def _counts(self) -> tuple[int, int, int]:
        with self._lock:
            outcomes = list(self._outcomes)
        return outcomes.count(SUCCESS), outcomes.count(FAULT), outcomes.count(THROTTLE)

    def observed(self) -> bool:
        """Whether any request's outcome has been seen (else the thresholds are the prior's)."""
        with self._lock:
            return bool(self._outcomes)

    def fault_rate(self) -> float:
        """Transient faults per fault or answer (throttles left out): the chance that a job
        meets one more fault before its answer."""
        ok, faults, _ = self._counts()
        return (faults + PRIOR_FAULTS) / (ok + PRIOR_SUCCESSES + faults + PRIOR_FAULTS)

    def throttle_rate(self) -> float:
        """Throttles per throttle or answer (faults left out): the chance of one more throttle
        before the answer."""
        ok, _, throttles = self._counts()
        return (throttles + PRIOR_FAULTS) / (ok + PRIOR_SUCCESSES + throttles + PRIOR_FAULTS)

    def fault_threshold(self) -> int:
        return evidence_threshold(self.fault_rate(), MIN_EVIDENCE_FAULTS, MAX_EVIDENCE_FAULTS)

    def throttle_threshold(self, low: int) -> int:
        return evidence_threshold(self.throttle_rate(), low, MAX_EVIDENCE_THROTTLES)
