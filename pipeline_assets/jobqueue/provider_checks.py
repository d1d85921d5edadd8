"""What the worker has learnt of the provider, and the trivial requests that ask the provider itself.

``ProviderView`` (shared by the worker's threads): its dimension, the configuration probe's answer,
a local pause after a throttle, whether a failure was seen, when it last answered usably, the
outcomes of recent requests (``jobqueue.evidence``) and the limit on requests in flight
(``jobqueue.send_limit``). ``ProviderChecks`` sends the trivial requests (``"ping"``, one token each, in
the ledger): the configuration probe after a 400, and whether the provider answers others after a
transient failure or, at start, after the unusable answers that stopped a worker.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pipeline_assets.jobqueue import ledger
from pipeline_assets.jobqueue.decisions import (
    ANSWERS,
    DOWN,
    MAX_UNMATCHED_ANSWERS,
    TOO_MANY_UNMATCHED_ANSWERS,
    UNUSABLE,
)
from pipeline_assets.jobqueue.evidence import FAULT, SUCCESS, THROTTLE, ProviderRates
from pipeline_assets.jobqueue.job_store import JobStore
from pipeline_assets.jobqueue.report import WorkerReport
from pipeline_assets.jobqueue.send_limit import SendLimit
from pipeline_assets.jobqueue.worker_config import DEFAULT_CONCURRENCY
from pipeline_assets.providers import FATAL, RETRYABLE, TERMINAL, THROTTLED, EmbedResult, Provider, ProviderError
from pipeline_assets.providers.base import BAD_RESPONSE

# The trivial input that tells a bad configuration from a bad input after a 400,
# and a provider that answers nobody from a bad input after a transient failure.
CONFIG_PROBE_TEXT = "ping"
# A usable answer this recent (before a failed request was sent, or any time
# after) shows the provider answers others: no trivial request is needed to know it.
RECENT_ANSWER_SECONDS = 5.0
# Trivial requests a check sends before it judges the provider down (each one a token): with
# 40% of requests failing at random, three fail together 6% of the time.
CHECK_TRIES = 3


@dataclass
class ProviderView:
    dimension: int | None  # the model's, once known (the recorded one wins)
    config_ok: bool | None = None  # the configuration probe's answer (None: not asked)
    paused_until: float = 0.0  # monotonic; a 429 seen here: send nothing more of held claims
    had_failure: bool = False  # reset the shared failure count only after failures
    unusable: int = 0  # unusable answers in a row, as last read from the database
    last_usable: float = float("-inf")  # monotonic; the provider's last usable answer to this worker
    checked: tuple[float, str] = (float("-inf"), ANSWERS)  # monotonic start and verdict of the last check
    rates: ProviderRates = field(default_factory=ProviderRates)
    limit: SendLimit = field(default_factory=lambda: SendLimit(DEFAULT_CONCURRENCY))
    check_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def paused(self) -> bool:
        return time.monotonic() < self.paused_until


@dataclass
class ProviderChecks:
    provider: Provider
    store: JobStore
    report: WorkerReport
    view: ProviderView
    # Set when the worker stops: no trivial request is sent after it (a stop is never held up
    # by up to ``CHECK_TRIES`` calls to a slow provider).
    stop_event: threading.Event = field(default_factory=threading.Event)

    def check_provider(self, sent_at: float) -> str:
        """Does the provider answer others? ``ANSWERS`` if a usable answer came
        shortly before ``sent_at`` or since; otherwise one trivial request tells
        (asked once by the worker's threads together: a check started after
        ``sent_at`` answers for every request sent before it; up to
        ``CHECK_TRIES`` of them while they fail). An unusable answer to it is
        counted in the database (every worker, across restarts)."""
        with self.view.check_lock:
            if self.view.last_usable >= sent_at - RECENT_ANSWER_SECONDS:
                return ANSWERS
            checked_at, verdict = self.view.checked
            if checked_at >= sent_at:
                return verdict
            if self.stop_event.is_set():
                return DOWN  # stopping: nothing more is sent, so nothing more is asked
            checked_at = time.monotonic()
            for _ in range(CHECK_TRIES):  # a flaky provider fails one trivial request, rarely all
                result, err = self._trivial_call("health_probe")
                self.view.rates.record(SUCCESS if err is None else THROTTLE if err.kind == THROTTLED else FAULT)
                if (
                    err is None
                    or err.kind not in (RETRYABLE, THROTTLED)
                    or err.error_class == BAD_RESPONSE
                    or self.stop_event.is_set()
                ):
                    break
            if err is None and result is not None and len(result.vectors) == 1:
                self.view.last_usable = time.monotonic()
                verdict = ANSWERS
                if self.view.unusable:
                    self.usable()
            elif err is None or err.error_class == BAD_RESPONSE:
                verdict = UNUSABLE
                self.view.unusable = self.store.provider_unusable()
                self.view.had_failure = True
            else:
                verdict = DOWN
            self.view.checked = (checked_at, verdict)
            return verdict

    def unusable_at_start(self) -> ProviderError | None:
        """Before claiming anything: if the provider's last answers (any worker's) were unusable up
        to the stop, one trivial request decides; the error to stop with at once, or None."""
        self.view.unusable = self.store.provider_unusable(count=False)
        if self.view.unusable < MAX_UNMATCHED_ANSWERS or self.stop_event.is_set():
            return None
        self.view.had_failure = True
        if self.check_provider(time.monotonic()) != UNUSABLE:
            return None
        return ProviderError(
            FATAL,
            TOO_MANY_UNMATCHED_ANSWERS,
            f"the provider sent {self.view.unusable} answers in a row that cannot be matched to their inputs, "
            "the last to a single trivial input, and still does; nothing was claimed: check the endpoint "
            "(OPENAI_BASE_URL) or the proxy in front of it",
        )

    def usable(self) -> None:
        """A usable answer after failures: close the breaker, reset the unusable answers in a row."""
        self.store.provider_healthy()
        self.view.had_failure = False
        self.view.unusable = 0

    def _trivial_call(self, outcome: str) -> tuple[EmbedResult, None] | tuple[None, ProviderError]:
        """One trivial request (``"ping"``, one token), in the ledger: (result, None) or (None, error)."""
        started = time.monotonic()
        call_id = self.store.record_send([], 1)
        self.report.add(provider_calls=1)
        try:
            result = embed(self.provider, [CONFIG_PROBE_TEXT])
        except ProviderError as err:
            self.store.record_failure(call_id, err, time.monotonic() - started, prefix=outcome + "_")
            return None, err
        self.store.record_outcome(
            call_id,
            outcome=outcome,
            status=200,
            latency=time.monotonic() - started,
            billed=ledger.BILLED,
            tokens=result.tokens,
        )
        return result, None

    def probe_config(self) -> None:
        """One trivial request (a single token) tells a bad input from a bad
        configuration; asked once per worker, after the first 400."""
        _, err = self._trivial_call("config_probe")
        self.view.config_ok = err is None or err.kind != TERMINAL


def embed(provider: Provider, texts: list[str]) -> EmbedResult:
    """The provider's answer; an answer its SDK could not parse at all (the openai SDK raises a
    bare ValueError for an answer with no embedding, e.g. a proxy that dropped the only one) is
    an unusable answer of the provider, as a wrong count of vectors is, not a fault of ours."""
    try:
        return provider.embed(texts)
    except ValueError as exc:
        raise ProviderError(RETRYABLE, BAD_RESPONSE, f"unusable answer for {len(texts)} inputs: {exc}") from None
