"""The contract of ``JobStore``, one suite for every implementation (in memory, PostgreSQL):
claim order and batching, lease expiry and reclaim, each transition, fencing, supersede,
the breaker, the ledger and splitting. Time moves only when a test advances it."""

from __future__ import annotations

import pytest

from pipeline_assets.jobqueue import ledger
from pipeline_assets.jobqueue.changes import Complete, Fail, GiveBack, Isolate, JobObserver, Retry, Supersede
from pipeline_assets.jobqueue.job_store import Answer
from pipeline_assets.jobqueue.outcomes import BreakerFailure
from pipeline_assets.providers import RETRYABLE, ProviderError
from pipeline_assets.store import db
from pipeline_assets_tests import job_store_harness as harness
from pipeline_assets_tests.job_store_harness import LEASE, A, B, claim_expired, ids, vec

DEAD_AFTER = 10.0  # a worker's liveness window


@pytest.fixture(params=["memory", "postgres"])
def world(request):
    if request.param == "memory":
        yield harness.MemoryHarness()
        return
    conn = request.getfixturevalue("clean_db")
    pool = db.make_pool(request.getfixturevalue("database_url"), min_size=1, max_size=2)
    try:
        yield harness.PostgresHarness(conn, pool)
    finally:
        pool.close()


# -- claim ------------------------------------------------------------------------------------


def test_claim_takes_batches_in_queue_order(world):
    store = world.store()
    _, jobs = world.enqueue(5)
    first = store.claim(owner=A, limit=2, lease_seconds=LEASE)
    assert ids(first) == jobs[:2]
    assert all(j.attempts == 1 and j.text and j.token_count == 3 and not j.probe for j in first)
    assert world.job(jobs[0]).status == "processing" and world.job(jobs[0]).lease_owner == A
    assert ids(store.claim(owner=B, limit=10, lease_seconds=LEASE)) == jobs[2:]
    assert store.claim(owner=B, limit=10, lease_seconds=LEASE) == []
    assert store.outstanding()


def test_a_job_waits_out_its_delay_and_then_comes_last(world):
    store = world.store()
    _, jobs = world.enqueue(3)
    assert ids(store.claim(owner=A, limit=1, lease_seconds=LEASE)) == jobs[:1]
    assert store.apply(A, [GiveBack((jobs[0],), delay=10.0)]) == {jobs[0]: "pending"}
    assert ids(store.claim(owner=B, limit=10, lease_seconds=LEASE)) == jobs[1:]
    store.apply(B, [GiveBack(tuple(jobs[1:]))])
    world.advance(11)
    assert ids(store.claim(owner=B, limit=2, lease_seconds=LEASE)) == jobs[1:]
    assert ids(store.claim(owner=B, limit=2, lease_seconds=LEASE)) == jobs[:1]


def test_a_scoped_store_claims_only_its_documents(world):
    _, outside = world.enqueue(2)
    doc, inside = world.enqueue(2)
    assert ids(world.store(scope=[doc]).claim(owner=A, limit=10, lease_seconds=LEASE)) == inside
    assert world.job(outside[0]).status == "pending"


def test_observers_are_told_what_was_claimed_applied_and_rescued(world):
    class Seen(JobObserver):
        claimed_jobs = 0

        def claimed(self, jobs) -> None:
            self.claimed_jobs += len(jobs)

        def applied(self, change, became) -> None:
            events.append((type(change).__name__, became))

        def rescued(self, count) -> None:
            events.append(("rescued", count))

    events: list[tuple] = []
    seen = Seen()
    store = world.store(observers=[seen])
    _, jobs = world.enqueue(2)
    store.claim(owner=A, limit=1, lease_seconds=LEASE)
    store.apply(A, [Fail((jobs[0],), "bad", "m")])
    store.claim(owner=A, limit=1, lease_seconds=1)
    world.advance(2)
    store.rescue()
    assert store.claimed == 2
    assert events == [("Fail", {jobs[0]: "failed"}), ("rescued", 1)]


# -- leases -----------------------------------------------------------------------------------


def test_an_expired_lease_is_rescued_as_a_fault_and_claimed_again(world):
    store = world.store()
    _, [job] = world.enqueue(1)
    store.claim(owner=A, limit=1, lease_seconds=LEASE)
    assert store.rescue() == 0
    world.advance(LEASE + 1)
    assert store.rescue() == 1
    row = world.job(job)
    assert (row.status, row.attempts, row.faults, row.lease_owner, row.error_class) == (
        "pending",
        0,
        1,
        None,
        "lease_expired",
    )
    [again] = store.claim(owner=B, limit=1, lease_seconds=LEASE)
    assert (again.job_id, again.attempts, again.faults, again.crashed) == (job, 1, 1, True)


@pytest.mark.parametrize("rescuer_silent", [False, True], ids=["rescuer-beating", "rescuer-silent-too"])
def test_a_dead_workers_claims_are_rescued_before_their_lease_ends(world, rescuer_silent):
    """Only a rescuer that kept beating may judge a silent worker dead (an outage silences all)."""
    store = world.store()
    _, [job] = world.enqueue(1)
    world.beat("w/a/", DEAD_AFTER)
    world.beat("w/r/", DEAD_AFTER)
    store.claim(owner=A, limit=1, lease_seconds=LEASE)
    for _ in range(2):
        world.advance(DEAD_AFTER * 0.6 if not rescuer_silent else DEAD_AFTER * 1.2)
        world.beat("w/r/", DEAD_AFTER)
    assert store.rescue("w/r/") == (0 if rescuer_silent else 1)
    assert world.job(job).error_class == (None if rescuer_silent else "worker_dead")


def test_the_heartbeat_keeps_a_lease_only_for_its_holder(world):
    store = world.store()
    _, [job] = world.enqueue(1)
    store.claim(owner=A, limit=1, lease_seconds=10)
    world.advance(6)
    store.extend_leases([(A, [job])], 10)
    store.extend_leases([(B, [job])], 1000)  # not the holder: nothing
    world.advance(6)
    assert store.rescue() == 0
    world.advance(5)
    assert store.rescue() == 1


# -- each transition --------------------------------------------------------------------------


def test_complete_stores_the_vector_and_settles_the_answer(world):
    store = world.store()
    _, jobs = world.enqueue(2)
    claimed = store.claim(owner=A, limit=2, lease_seconds=LEASE)
    call = store.record_send(claimed, 6)
    assert world.call(call)[:2] == ("sent", ledger.MAYBE_BILLED)
    assert store.apply(A, [Complete(tuple(jobs), (vec(), vec(2)))], answer=Answer(call, 7, 0.1)) == {
        jobs[0]: "ready",
        jobs[1]: "ready",
    }
    assert world.job(jobs[0]).has_vector and world.job(jobs[0]).lease_owner is None
    assert world.call(call) == ("ok", ledger.BILLED, 7)
    assert not store.outstanding()


@pytest.mark.parametrize("attempts, became", [(1, "retry"), (2, "failed")])
def test_retry_uses_the_attempt_and_fails_when_they_are_used_up(world, attempts, became):
    store = world.store()
    _, [job] = world.enqueue(1, max_attempts=2)
    store.claim(owner=A, limit=1, lease_seconds=LEASE)
    if attempts == 2:  # the second attempt
        store.apply(A, [Retry((job,), (0.0,), "http_500", "m")])
        store.claim(owner=A, limit=1, lease_seconds=LEASE)
    assert store.apply(A, [Retry((job,), (5.0,), "http_500", "m")]) == {job: became}
    assert world.job(job).error_class == "http_500"
    assert store.claim(owner=B, limit=1, lease_seconds=LEASE) == []
    world.advance(6)
    assert len(store.claim(owner=B, limit=1, lease_seconds=LEASE)) == (became == "retry")


def test_give_back_returns_the_attempt_and_counts_throttles_and_faults(world):
    store = world.store()
    _, [job] = world.enqueue(1)
    store.claim(owner=A, limit=1, lease_seconds=LEASE)
    assert store.apply(A, [GiveBack((job,), throttled=True, faulted=True, error_class="throttled")]) == {job: "pending"}
    row = world.job(job)
    assert (row.attempts, row.throttles, row.faults, row.error_class) == (0, 1, 1, "throttled")


def test_fail_dead_letters_at_once(world):
    store = world.store()
    _, [job] = world.enqueue(1)
    store.claim(owner=A, limit=1, lease_seconds=LEASE)
    assert store.apply(A, [Fail((job,), "bad_input", "m")]) == {job: "failed"}
    assert world.job(job).error_class == "bad_input"
    assert store.claim(owner=A, limit=1, lease_seconds=LEASE) == []


def test_a_split_isolates_once_and_applies_mixed_outcomes_together(world):
    store = world.store()
    _, jobs = world.enqueue(4)
    store.claim(owner=A, limit=4, lease_seconds=LEASE)
    assert store.apply(A, [Isolate(tuple(jobs))]) == dict.fromkeys(jobs, "processing")
    assert store.apply(A, [Isolate(tuple(jobs))]) == {}  # already isolated
    became = store.apply(
        A,
        [
            Complete((jobs[0],), (vec(),)),
            Fail((jobs[1],), "bad", "m"),
            Complete((jobs[2],), (vec(),)),
            GiveBack((jobs[3],)),
        ],
    )
    assert became == {jobs[0]: "ready", jobs[1]: "failed", jobs[2]: "ready", jobs[3]: "pending"}
    [alone] = store.claim(owner=B, limit=4, lease_seconds=LEASE)
    assert alone.isolate and world.job(jobs[3]).isolate


# -- supersede ---------------------------------------------------------------------------------


def test_content_gone_while_held_is_superseded_not_stored(world):
    store = world.store()
    _, jobs = world.enqueue(3)
    store.claim(owner=A, limit=3, lease_seconds=LEASE)
    world.drop_content(jobs[1])
    assert store.apply(A, [Complete(tuple(jobs), (vec(), vec(), vec()))]) == {
        jobs[0]: "ready",
        jobs[1]: "superseded",
        jobs[2]: "ready",
    }
    assert not world.job(jobs[1]).has_vector
    assert store.apply(A, []) == {}


def test_a_claim_without_text_is_superseded_by_its_holder(world):
    store = world.store()
    _, [job] = world.enqueue(1)
    world.drop_content(job)
    [claimed] = store.claim(owner=A, limit=1, lease_seconds=LEASE)
    assert claimed.text is None
    assert store.apply(A, [Supersede((job,))]) == {job: "superseded"}


# -- fencing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        lambda j: Complete((j,), (vec(),)),
        lambda j: Retry((j,), (0.0,), "e", "m"),
        lambda j: GiveBack((j,)),
        lambda j: Fail((j,), "e", "m"),
        lambda j: Supersede((j,)),
        lambda j: Isolate((j,)),
    ],
    ids=["complete", "retry", "give_back", "fail", "supersede", "isolate"],
)
def test_a_stale_holder_moves_nothing(world, change):
    store = world.store()
    _, [job] = world.enqueue(1)
    claim_expired(world, store, [job])
    assert store.apply(A, [change(job)]) == {}
    row = world.job(job)
    assert (row.status, row.lease_owner, row.has_vector, row.isolate) == ("processing", B, False, False)
    assert store.apply(B, [Complete((job,), (vec(),))]) == {job: "ready"}


def test_a_finished_job_refuses_a_second_completion(world):
    store = world.store()
    _, [job] = world.enqueue(1)
    store.claim(owner=A, limit=1, lease_seconds=LEASE)
    store.apply(A, [Complete((job,), (vec(),))])
    assert store.apply(A, [Complete((job,), (vec(9),))]) == {}
    assert store.apply(A, [GiveBack((job,))]) == {}


# -- faults: the breaker, the ledger ------------------------------------------------------------


def test_a_tripped_breaker_lets_one_probe_through_after_its_pause(world):
    store = world.store(base=1.0, cap=60.0)
    world.enqueue(3)
    store.provider_failure(BreakerFailure(trip=True, floor=10.0))
    assert store.claim(owner=A, limit=3, lease_seconds=LEASE) == []
    world.advance(11)
    probe = store.claim(owner=A, limit=3, lease_seconds=LEASE)
    assert probe and all(j.probe for j in probe)
    assert store.claim(owner=B, limit=3, lease_seconds=LEASE) == []  # one probe at a time
    store.apply(A, [GiveBack(tuple(ids(probe)))])
    store.release_probe(A)
    assert store.claim(owner=B, limit=1, lease_seconds=LEASE)[0].probe
    store.provider_healthy()
    assert not any(j.probe for j in store.claim(owner=B, limit=3, lease_seconds=LEASE))


def test_a_throttle_pauses_every_claim_without_tripping(world):
    store = world.store(base=1.0, cap=60.0)
    world.enqueue(1)
    store.provider_failure(BreakerFailure(trip=False, floor=5.0, pause_only=True))
    assert store.claim(owner=A, limit=1, lease_seconds=LEASE) == []
    world.advance(6)
    [job] = store.claim(owner=A, limit=1, lease_seconds=LEASE)
    assert not job.probe


def test_failed_sends_are_settled_by_whether_they_may_have_been_billed(world):
    store = world.store(worker_run="w/a/")
    other = world.store(worker_run="w/b/")
    refused, lost = store.record_send([], 5), store.record_send([], 8)
    other.record_send([], 100)
    store.record_failure(refused, ProviderError(RETRYABLE, "http_500", "m", status=500), 0.1)
    store.record_failure(lost, ProviderError(RETRYABLE, "timeout", "m", billed_maybe=True), 0.1)
    assert world.call(refused) == ("http_500", ledger.NOT_BILLED, 0)
    assert world.call(lost) == ("timeout", ledger.MAYBE_BILLED, 8)
    assert store.tokens_today_of_others() == 100


def test_unusable_answers_are_counted_until_a_usable_one(world):
    store = world.store()
    assert store.provider_unusable(count=False) == 0
    assert [store.provider_unusable() for _ in range(2)] == [1, 2]
    store.provider_healthy()
    assert store.provider_unusable(count=False) == 0


def test_the_first_recorded_dimension_wins(world):
    store = world.store()
    assert store.register_model(harness.SPEC) == 4
    assert store.record_dimension(8) == 4
