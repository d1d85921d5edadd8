"""The executor on the in-memory queue: one claim carried out against the fake
OpenAI server through the real openai SDK, with no database. Each test asserts
what the jobs became, the vectors stored and what the provider billed.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from pipeline_assets.jobqueue import leases, ledger
from pipeline_assets.jobqueue.changes import Complete
from pipeline_assets.jobqueue.decisions import DOWN
from pipeline_assets.jobqueue.executor import Executor, Stopping
from pipeline_assets.jobqueue.executor_config import ExecutorConfig
from pipeline_assets.jobqueue.memory_job_store import MemoryJobStore
from pipeline_assets.jobqueue.memory_queue import MemoryQueue
from pipeline_assets.jobqueue.provider_checks import CHECK_TRIES, ProviderView
from pipeline_assets.jobqueue.report import ReportCounts, WorkerReport
from pipeline_assets_tests.job_store_harness import ManualClock
from pipeline_assets_tests.processes import wait_until

LEASE = 30.0
HEARTBEAT_LEASE = 0.6  # a third of it is the heartbeat's interval, in real seconds
BATCH = 16
OWNER, OTHER = "w/x/1", "w/y/1"
WAIT = 30.0  # bound of a wait on a condition
BACKOFF_BASE, BACKOFF_CAP = 1.0, 60.0
RESCUE_BACKOFF = 2 * BACKOFF_BASE  # the longest backoff of a job rescued after its first fault


def checksum(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@dataclass
class Rig:
    fake: object
    clock: ManualClock
    queue: MemoryQueue
    store: MemoryJobStore
    executor: Executor
    report: WorkerReport

    def add(self, *texts: str) -> list[int]:
        self.queue.add_content(1, [(checksum(t), t, len(t.split())) for t in texts])
        return self.queue.enqueue([checksum(t) for t in texts], max_attempts=5)

    def run(self, owner: str = OWNER) -> None:
        self.executor.run_claim(owner, self.store.claim(owner=owner, limit=BATCH, lease_seconds=LEASE), BATCH)

    def status(self, *job_ids: int) -> list[str]:
        return [self.queue.jobs[i].status for i in job_ids]

    def vector(self, text: str):
        return self.queue.vectors.get((checksum(text), self.store.model_id))


@pytest.fixture
def rig(fake):
    provider = fake.provider(max_batch_inputs=BATCH)
    clock = ManualClock()
    queue = MemoryQueue(clock=clock)
    report = WorkerReport()
    store = MemoryJobStore(
        queue,
        model_id=provider.spec.model_id,
        worker_run="w/x/",
        backoff_base=BACKOFF_BASE,
        backoff_cap=BACKOFF_CAP,
        observers=[ReportCounts(report)],
    )
    executor = Executor(
        provider,
        store,
        ExecutorConfig(),
        poll_seconds=0.05,
        lease_seconds=LEASE,
        report=report,
        stopping=Stopping(threading.Event()),
        view=ProviderView(store.register_model(provider.spec)),
    )
    try:
        yield Rig(fake, clock, queue, store, executor, report)
    finally:
        provider.close()


def test_a_claim_is_embedded_stored_and_billed_once(rig):
    texts = ["alpha one", "beta two", "gamma three"]
    jobs = rig.add(*texts)
    rig.run()
    assert rig.status(*jobs) == ["ready"] * 3
    for text in texts:
        assert np.allclose(rig.vector(text), rig.fake.vector_for(text))
        assert rig.fake.billed_count(text) == 1
    [call] = rig.queue.calls
    assert (call.outcome, call.billed, call.tokens) == ("ok", ledger.BILLED, rig.fake.stats["billed_tokens"])
    assert rig.report.embedded == 3 and rig.queue.models[rig.store.model_id].dimension == len(rig.vector(texts[0]))


def test_a_poison_input_is_dead_lettered_alone_and_the_rest_complete(rig):
    rig.fake.poison_marker = "POISON"
    texts = ["one", "two", "three POISON", "four"]
    jobs = rig.add(*texts)
    rig.run()
    assert rig.status(*jobs) == ["ready", "ready", "failed", "ready"]
    assert rig.vector(texts[2]) is None
    assert all(rig.fake.billed_count(t) == 1 for t in texts if "POISON" not in t)


def test_a_throttle_gives_the_batch_back_and_pauses_every_claim(rig):
    jobs = rig.add("a", "b")
    rig.fake.fail_next(1, 429, retry_after=5)
    rig.run()
    assert rig.status(*jobs) == ["pending", "pending"]
    assert [(rig.queue.jobs[j].attempts, rig.queue.jobs[j].throttles) for j in jobs] == [(0, 1), (0, 1)]
    assert rig.store.claim(owner=OTHER, limit=BATCH, lease_seconds=LEASE) == []  # every worker pauses
    rig.clock.now += 6
    assert len(rig.store.claim(owner=OTHER, limit=BATCH, lease_seconds=LEASE)) == 2


def test_a_throttle_pauses_this_process_before_the_breaker_is_written(rig, monkeypatch):
    """The other threads of the worker see the pause at once, not one database round trip later
    (a fast provider let one start another call in that time)."""
    seen = []
    write_breaker = rig.store.provider_failure

    def provider_failure(*args, **kwargs):
        seen.append(rig.executor.view.paused)
        return write_breaker(*args, **kwargs)

    monkeypatch.setattr(rig.store, "provider_failure", provider_failure)
    rig.add("a", "b")
    rig.fake.fail_next(1, 429, retry_after=5)
    rig.run()
    assert seen == [True]


def test_a_nan_vector_retries_only_its_input(rig):
    rig.fake.nan_marker = "NAN"
    jobs = rig.add("good one", "bad NAN", "good two")
    rig.run()
    assert rig.status(*jobs) == ["ready", "retry", "ready"]
    assert rig.vector("bad NAN") is None and rig.queue.jobs[jobs[1]].attempts == 1


def test_content_gone_before_the_call_is_superseded_without_a_request(rig):
    [job] = rig.add("gone")
    rig.queue.drop_content(checksum("gone"))
    rig.run()
    assert rig.status(job) == ["superseded"]
    assert rig.fake.stats["requests"] == 0


def test_a_fatal_error_hands_the_claim_back_untouched_and_stops(rig):
    jobs = rig.add("a", "b")
    rig.fake.fail_next(1, 401)
    rig.run()
    assert rig.status(*jobs) == ["pending", "pending"]
    assert all(rig.queue.jobs[j].attempts == 0 for j in jobs)
    assert rig.executor.stopping.fatal is not None and rig.executor.stopping.event.is_set()


def test_a_completion_after_the_lease_was_lost_is_refused(rig):
    """The answer comes after the lease expired and another worker claimed the job:
    the stale holder stores nothing; the new holder completes it."""
    [job] = rig.add("slow HOLD")
    rig.fake.hold("HOLD")
    thread = threading.Thread(target=rig.run)
    thread.start()
    try:
        wait_until(lambda: rig.fake.held == 1, timeout=WAIT, what="the request held")
        rig.clock.now += LEASE + 1
        assert rig.store.rescue() == 1
        rig.clock.now += RESCUE_BACKOFF  # the rescued job waits out its backoff
        [again] = rig.store.claim(owner=OTHER, limit=BATCH, lease_seconds=LEASE)
    finally:
        rig.fake.release()
        thread.join(WAIT)
    assert not thread.is_alive()
    assert rig.status(job) == ["processing"] and rig.queue.jobs[job].lease_owner == OTHER
    assert rig.vector("slow HOLD") is None and rig.report.embedded == 0
    assert rig.queue.calls[0].billed == ledger.BILLED  # the refused answer was paid for all the same
    assert rig.store.apply(OTHER, [Complete((again.job_id,), (np.ones(16, dtype=np.float32),))]) == {job: "ready"}


def test_the_heartbeat_extends_healthy_leases_only(rig):
    """A held claim whose deadline has not passed is extended; a stalled one (its
    deadline passed) is not, so it expires and is rescued."""
    healthy, stalled = rig.add("healthy"), rig.add("stalled")
    rig.store.claim(owner=OWNER, limit=1, lease_seconds=HEARTBEAT_LEASE)
    rig.store.claim(owner=OTHER, limit=1, lease_seconds=HEARTBEAT_LEASE)
    rig.executor.leases.hold(OWNER, healthy, time.monotonic() + WAIT)
    rig.executor.leases.hold(OTHER, stalled, time.monotonic() - 1)
    rig.clock.now += HEARTBEAT_LEASE / 2
    stop = threading.Event()
    beat = threading.Thread(target=leases.heartbeat, args=(rig.executor.leases, rig.store, HEARTBEAT_LEASE, stop))
    beat.start()
    try:
        wait_until(
            lambda: rig.queue.jobs[healthy[0]].lease_expires_at == rig.clock.now + HEARTBEAT_LEASE,
            timeout=WAIT,
            what="the healthy lease extended",
        )
    finally:
        stop.set()
        beat.join(WAIT)
    rig.clock.now += HEARTBEAT_LEASE * 0.75
    assert rig.store.rescue() == 1
    assert rig.status(*healthy, *stalled) == ["processing", "pending"]


def test_one_5xx_on_a_batch_costs_no_attempt_and_isolates_nothing(rig):
    """A transient fault of a provider that answers others is the request's, not its inputs'."""
    jobs = rig.add("a", "b", "c")
    rig.fake.fail_next(1, 500)
    rig.run()
    assert rig.status(*jobs) == ["pending"] * 3
    assert [(rig.queue.jobs[j].attempts, rig.queue.jobs[j].faults, rig.queue.jobs[j].isolate) for j in jobs] == [
        (0, 1, False)
    ] * 3


def test_an_unmatchable_answer_is_given_back_and_billed_as_maybe(rig):
    """An answer one vector short cannot be matched to its inputs: nothing is stored,
    no attempt is used, and the send stays counted as possibly billed."""
    jobs = rig.add("a", "b")
    rig.fake.short_rate = 1.0
    rig.run()
    assert all(rig.vector(t) is None for t in ("a", "b"))
    assert [rig.queue.jobs[j].attempts for j in jobs] == [0, 0]
    assert rig.queue.calls[0].billed == ledger.MAYBE_BILLED


def test_a_stopping_worker_asks_the_provider_nothing(rig):
    """Whether the provider answers others is not asked once the worker stops: a stop is
    never held up by trivial requests to a slow provider."""
    rig.executor.stopping.event.set()
    assert rig.executor.checks.check_provider(time.monotonic()) == DOWN
    assert rig.fake.stats["requests"] == 0


class StopsAfterOneCall:
    """The provider, with the worker told to stop during the first call."""

    def __init__(self, provider, stop: threading.Event) -> None:
        self._provider, self._stop = provider, stop

    def __getattr__(self, name):
        return getattr(self._provider, name)

    def embed(self, texts):
        try:
            return self._provider.embed(texts)
        finally:
            self._stop.set()


def test_a_stop_during_the_check_ends_its_tries(rig):
    """The check tries up to CHECK_TRIES trivial requests while they fail; a stop after the
    first ends it there."""
    rig.fake.fail_next(CHECK_TRIES, 500)
    checks = rig.executor.checks
    checks.provider = StopsAfterOneCall(checks.provider, rig.executor.stopping.event)
    assert checks.check_provider(time.monotonic()) == DOWN
    assert rig.fake.stats["requests"] == 1
