"""Unit tests of every transition of the job state machine (app.embedding_jobs).

Each test builds the minimal rows itself (model, source, document, chunks with
chosen checksums, jobs via ``transitions.enqueue_for_docs``), drives the jobs through
the functions of ``pipeline_assets.jobqueue.transitions`` against the real database, and
asserts on the resulting rows: status, attempts, lease, available_at relative to
the database clock, error_class and the presence of the app.embeddings row.
Refused transitions are asserted too: the function reports nothing moved and
the row is exactly as before.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

import numpy as np
import psycopg
import psycopg.errors
import pytest

from pipeline_assets.jobqueue import transitions
from pipeline_assets.jobqueue.request_plan import FREE_FAULTS
from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import models
from pipeline_assets.store import db
from pipeline_assets_tests import job_helpers

SPEC = ModelSpec(
    provider="test", name="m", dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
)
SPEC2 = ModelSpec(
    provider="test", name="m2", dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
)
MODEL = SPEC.model_id
MODEL2 = SPEC2.model_id
OWNER = "worker-1"
OTHER = "worker-2"
LEASE = 30.0
TOL = 5.0  # seconds of slack between a transition's now() and the assertion's now()

STATES = ("pending", "processing", "retry", "ready", "failed", "superseded")


# --------------------------------------------------------------------------- helpers


def checksum(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def vec(x: float) -> np.ndarray:
    return np.array([x, 1.0, 2.0, 3.0], dtype=np.float32)


_labels = iter(range(10**9))


def seed(conn, n: int = 1, *, max_attempts: int = 5, labels: list[str] | None = None, model: str = MODEL) -> list[int]:
    """A new current document with n chunks (fresh checksums unless labels are given), enqueued.

    Returns the job ids of ``model`` for those chunks, in chunk order.
    """
    if labels is None:
        labels = [f"chunk-{next(_labels)}" for _ in range(n)]
    sums = [checksum(label) for label in labels]
    doc_pk = add_document(conn)
    add_chunks(conn, doc_pk, sums)
    transitions.enqueue_for_docs(conn, [doc_pk], max_attempts)
    rows = dict(
        conn.execute(
            "SELECT chunk_checksum, job_id FROM app.embedding_jobs WHERE model_id = %s AND chunk_checksum = ANY(%s)",
            (model, sums),
        ).fetchall()
    )
    return [rows[s] for s in sums]


def add_document(conn) -> int:
    source_id = conn.execute(
        "INSERT INTO app.sources (root) VALUES ('/test-source') ON CONFLICT (root) DO UPDATE SET root = EXCLUDED.root"
        " RETURNING source_id"
    ).fetchone()[0]
    document_id = f"doc-{next(_labels)}"
    return conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status) VALUES (%s, %s, %s, 'current')"
        " RETURNING doc_pk",
        (source_id, document_id, f"file:///{document_id}"),
    ).fetchone()[0]


def add_chunks(conn, doc_pk: int, sums: list[bytes]) -> None:
    start = conn.execute(
        "SELECT coalesce(max(chunk_index) + 1, 0) FROM app.chunks WHERE doc_pk = %s", (doc_pk,)
    ).fetchone()[0]
    for i, s in enumerate(sums):
        conn.execute(
            "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end)"
            " VALUES (%s, %s, %s, %s, 3, 0, 10)",
            (doc_pk, start + i, s, f"text of {s.hex()[:12]}"),
        )


def checksum_of(conn, job_id: int) -> bytes:
    return conn.execute("SELECT chunk_checksum FROM app.embedding_jobs WHERE job_id = %s", (job_id,)).fetchone()[0]


def drop_chunks(conn, job_id: int) -> None:
    """The content of the job is no longer wanted: no chunk carries its checksum."""
    conn.execute("DELETE FROM app.chunks WHERE chunk_checksum = %s", (checksum_of(conn, job_id),))


def restore_chunk(conn, job_id: int) -> None:
    """The content is wanted again: a chunk of a new document carries the checksum."""
    add_chunks(conn, add_document(conn), [checksum_of(conn, job_id)])


@dataclass
class Job:
    status: str
    attempts: int
    max_attempts: int
    lease_owner: str | None
    lease_in: float | None  # lease_expires_at - now(), seconds
    available_in: float  # available_at - now(), seconds
    error_class: str | None
    error_message: str | None
    vector: np.ndarray | None  # the app.embeddings row, if any


def job(conn, job_id: int) -> Job:
    r = conn.execute(
        """
        SELECT j.status, j.attempts, j.max_attempts, j.lease_owner,
               extract(epoch FROM j.lease_expires_at - now())::float8,
               extract(epoch FROM j.available_at - now())::float8,
               j.error_class, j.error_message, e.embedding
        FROM app.embedding_jobs j
        LEFT JOIN app.embeddings e ON e.chunk_checksum = j.chunk_checksum AND e.model_id = j.model_id
        WHERE j.job_id = %s""",
        (job_id,),
    ).fetchone()
    assert r is not None, f"job {job_id} does not exist"
    vector = None if r[8] is None else np.asarray(r[8].to_numpy())
    return Job(*r[:8], vector)


def claim_ids(conn, *, owner: str = OWNER, limit: int = 100, lease: float = LEASE, model: str = MODEL) -> list[int]:
    return [c.job_id for c in transitions.claim(conn, model_id=model, owner=owner, limit=limit, lease_seconds=lease)]


def hold(conn, job_id: int, *, owner: str = OWNER, lease: float = LEASE) -> None:
    """Claim exactly this job: other claimable jobs are pushed out of reach for the claim and put back."""
    hide = (
        "UPDATE app.embedding_jobs SET available_at = available_at {} interval '100 years'"
        " WHERE job_id <> %s AND status IN ('pending', 'retry')"
    )
    conn.execute(hide.format("+"), (job_id,))
    try:
        assert claim_ids(conn, owner=owner, lease=lease) == [job_id]
    finally:
        conn.execute(hide.format("-"), (job_id,))


def assert_no_lease(j: Job) -> None:
    assert j.lease_owner is None
    assert j.lease_in is None


def assert_about(value: float, expected: float) -> None:
    """A timestamp set to now()+expected by an earlier statement, read at a later now()."""
    assert expected - TOL <= value <= expected + 0.001, (value, expected)


def status_counts(conn) -> dict[str, int]:
    return dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY status").fetchall())


def to_state(conn, state: str, *, max_attempts: int = 5, owner: str = OWNER) -> int:
    """A new job driven into ``state`` through the queue functions; its content is wanted."""
    jid = seed(conn, 1, max_attempts=max_attempts)[0]
    if state == "pending":
        return jid
    hold(conn, jid, owner=owner)
    if state == "processing":
        return jid
    if state == "retry":
        assert job_helpers.fail_retryable(
            conn, owner=owner, job_ids=[jid], delays=[0.0], error_class="e", message="m"
        ) == {jid: "retry"}
    elif state == "ready":
        assert job_helpers.complete(conn, owner=owner, job_ids=[jid], vectors=[vec(1)]) == ([jid], [])
    elif state == "failed":
        assert job_helpers.fail_terminal(conn, owner=owner, job_ids=[jid], error_class="bad", message="m") == [jid]
    elif state == "superseded":
        drop_chunks(conn, jid)
        assert job_helpers.complete(conn, owner=owner, job_ids=[jid], vectors=[vec(1)]) == ([], [jid])
        restore_chunk(conn, jid)
    else:
        raise ValueError(state)
    assert job(conn, jid).status == state
    return jid


@pytest.fixture
def q(clean_db):
    """An empty database with one active model (test/m@4)."""
    models.ensure_model(clean_db, SPEC)
    return clean_db


# --------------------------------------------------------------------------- claim


def test_claim_pending_to_processing(q):
    [jid] = seed(q, 1, max_attempts=3, labels=["alpha"])
    before = job(q, jid)
    assert (before.status, before.attempts, before.lease_owner, before.vector) == ("pending", 0, None, None)

    [claimed] = transitions.claim(q, model_id=MODEL, owner=OWNER, limit=10, lease_seconds=LEASE)
    assert claimed.job_id == jid
    assert claimed.chunk_checksum == checksum("alpha")
    assert (claimed.attempts, claimed.max_attempts) == (1, 3)
    assert claimed.text == f"text of {checksum('alpha').hex()[:12]}"

    j = job(q, jid)
    assert j.status == "processing"
    assert j.attempts == 1
    assert j.lease_owner == OWNER
    assert_about(j.lease_in, LEASE)  # lease expiry from the database clock
    assert j.error_class is None
    assert j.vector is None


def test_claim_reports_text_none_when_content_gone(q):
    [jid] = seed(q, 1)
    drop_chunks(q, jid)
    [claimed] = transitions.claim(q, model_id=MODEL, owner=OWNER, limit=10, lease_seconds=LEASE)
    assert claimed.job_id == jid and claimed.text is None
    assert job(q, jid).status == "processing"


def test_claim_retry_to_processing(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    job_helpers.fail_retryable(q, owner=OWNER, job_ids=[jid], delays=[0.0], error_class="http_500", message="boom")
    assert job(q, jid).status == "retry"

    [claimed] = transitions.claim(q, model_id=MODEL, owner=OTHER, limit=10, lease_seconds=120)
    assert (claimed.job_id, claimed.attempts) == (jid, 2)
    j = job(q, jid)
    assert (j.status, j.attempts, j.lease_owner) == ("processing", 2, OTHER)
    assert_about(j.lease_in, 120)
    assert j.vector is None


def test_retry_not_claimed_before_available_at(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    job_helpers.fail_retryable(q, owner=OWNER, job_ids=[jid], delays=[3600.0], error_class="http_500", message="boom")

    assert claim_ids(q, owner=OTHER) == []
    j = job(q, jid)
    assert (j.status, j.attempts, j.lease_owner) == ("retry", 1, None)
    assert_about(j.available_in, 3600)

    q.execute("UPDATE app.embedding_jobs SET available_at = now() - interval '1 second' WHERE job_id = %s", (jid,))
    assert claim_ids(q, owner=OTHER) == [jid]


def test_pending_not_claimed_before_available_at(q):
    [jid] = seed(q, 1)
    q.execute("UPDATE app.embedding_jobs SET available_at = now() + interval '1 hour' WHERE job_id = %s", (jid,))
    assert claim_ids(q) == []
    assert job(q, jid).status == "pending"


def test_paused_provider_blocks_claims_of_that_model_only(q):
    models.ensure_model(q, SPEC2)
    ids1 = seed(q, 3, model=MODEL)
    ids2 = [
        r[0] for r in q.execute("SELECT job_id FROM app.embedding_jobs WHERE model_id = %s ORDER BY job_id", (MODEL2,))
    ]
    assert len(ids2) == 3

    assert job_helpers.pause_provider(q, MODEL, 60) == 1
    assert claim_ids(q, model=MODEL) == []
    assert all(job(q, i).status == "pending" and job(q, i).attempts == 0 for i in ids1)
    assert sorted(claim_ids(q, model=MODEL2)) == ids2

    # A second pause counts a consecutive failure and never shortens the pause.
    assert job_helpers.pause_provider(q, MODEL, 1) == 2
    assert claim_ids(q, model=MODEL) == []

    q.execute("UPDATE app.provider_state SET paused_until = now() - interval '1 second' WHERE model_id = %s", (MODEL,))
    assert sorted(claim_ids(q, model=MODEL)) == sorted(ids1)


def test_claim_respects_batch_limit_in_order(q):
    ids = sorted(seed(q, 10))
    first = claim_ids(q, limit=3)
    assert sorted(first) == ids[:3]  # oldest available first, then by job id
    assert status_counts(q) == {"processing": 3, "pending": 7}
    rest = claim_ids(q, owner=OTHER, limit=100)
    assert sorted(rest) == ids[3:]
    assert claim_ids(q, limit=100) == []
    assert status_counts(q) == {"processing": 10}


def test_concurrent_claims_never_share_a_job(q, database_url):
    ids = seed(q, 200)
    barrier = threading.Barrier(2)
    got: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def worker(owner: str) -> None:
        mine: list[int] = []
        try:
            with db.connect(database_url) as c:
                barrier.wait(timeout=60)
                while True:
                    batch = claim_ids(c, owner=owner, limit=7)
                    assert len(batch) <= 7
                    if not batch:
                        break
                    mine.extend(batch)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
        got[owner] = mine

    threads = [threading.Thread(target=worker, args=(o,)) for o in ("t1", "t2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    a, b = got["t1"], got["t2"]
    assert len(a) == len(set(a)) and len(b) == len(set(b))
    assert set(a) & set(b) == set()
    assert set(a) | set(b) == set(ids)
    # Every job was claimed exactly once: one attempt each, owned by the thread that got it.
    rows = dict(
        q.execute(
            "SELECT job_id, lease_owner FROM app.embedding_jobs WHERE status = 'processing' AND attempts = 1"
        ).fetchall()
    )
    assert len(rows) == 200
    assert all(rows[i] == "t1" for i in a) and all(rows[i] == "t2" for i in b)


@pytest.mark.parametrize("state", ["ready", "failed", "superseded", "processing"])
def test_claim_never_takes_a_job_out_of(q, state):
    jid = to_state(q, state)
    before = job(q, jid)
    assert claim_ids(q, owner=OTHER) == []
    after = job(q, jid)
    assert (after.status, after.attempts, after.lease_owner) == (before.status, before.attempts, before.lease_owner)


# --------------------------------------------------------------------------- complete


def test_complete_processing_to_ready_stores_vector(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    job_helpers.fail_retryable(q, owner=OWNER, job_ids=[jid], delays=[0.0], error_class="http_500", message="boom")
    hold(q, jid)
    assert job(q, jid).error_class == "http_500"

    assert job_helpers.complete(q, owner=OWNER, job_ids=[jid], vectors=[vec(7)]) == ([jid], [])
    j = job(q, jid)
    assert (j.status, j.attempts) == ("ready", 2)
    assert_no_lease(j)
    assert j.error_class is None and j.error_message is None
    np.testing.assert_allclose(j.vector, vec(7))


def test_complete_refused_for_wrong_owner(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    assert job_helpers.complete(q, owner=OTHER, job_ids=[jid], vectors=[vec(1)]) == ([], [])
    j = job(q, jid)
    assert (j.status, j.lease_owner, j.attempts) == ("processing", OWNER, 1)
    assert j.vector is None
    # The rightful owner still can.
    assert job_helpers.complete(q, owner=OWNER, job_ids=[jid], vectors=[vec(2)]) == ([jid], [])
    np.testing.assert_allclose(job(q, jid).vector, vec(2))


def test_complete_refused_after_lease_rescued(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    q.execute("UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second' WHERE job_id = %s", (jid,))
    assert transitions.rescue_expired(q) == {"retry": 1, "failed": 0, "superseded": 0}

    assert job_helpers.complete(q, owner=OWNER, job_ids=[jid], vectors=[vec(1)]) == ([], [])
    j = job(q, jid)
    assert (j.status, j.error_class) == ("pending", "lease_expired")  # its attempt given back
    assert_no_lease(j)
    assert j.vector is None

    # Someone else claims it: the old owner is still refused, the new one wins.
    hold(q, jid, owner=OTHER)
    assert job_helpers.complete(q, owner=OWNER, job_ids=[jid], vectors=[vec(1)]) == ([], [])
    assert job(q, jid).vector is None
    assert job_helpers.complete(q, owner=OTHER, job_ids=[jid], vectors=[vec(3)]) == ([jid], [])
    np.testing.assert_allclose(job(q, jid).vector, vec(3))


def test_complete_when_chunk_gone_supersedes(q):
    keep, gone = seed(q, 2)
    assert sorted(claim_ids(q)) == sorted([keep, gone])
    drop_chunks(q, gone)

    ready, superseded = job_helpers.complete(q, owner=OWNER, job_ids=[keep, gone], vectors=[vec(1), vec(2)])
    assert (ready, superseded) == ([keep], [gone])
    g = job(q, gone)
    assert g.status == "superseded"
    assert_no_lease(g)
    assert g.vector is None
    k = job(q, keep)
    assert k.status == "ready"
    np.testing.assert_allclose(k.vector, vec(1))


def test_complete_for_inactive_model_supersedes(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    q.execute("UPDATE app.models SET active = false WHERE model_id = %s", (MODEL,))
    assert job_helpers.complete(q, owner=OWNER, job_ids=[jid], vectors=[vec(1)]) == ([], [jid])
    j = job(q, jid)
    assert j.status == "superseded" and j.vector is None


def test_second_completion_refused_and_vector_kept(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    assert job_helpers.complete(q, owner=OWNER, job_ids=[jid], vectors=[vec(1)]) == ([jid], [])
    for owner in (OWNER, OTHER):
        assert job_helpers.complete(q, owner=owner, job_ids=[jid], vectors=[vec(9)]) == ([], [])
        j = job(q, jid)
        assert (j.status, j.attempts) == ("ready", 1)
        np.testing.assert_allclose(j.vector, vec(1))


# --------------------------------------------------------------------------- fail_retryable


def test_fail_retryable_processing_to_retry(q):
    a, b = seed(q, 2)
    assert sorted(claim_ids(q)) == sorted([a, b])
    moved = job_helpers.fail_retryable(
        q, owner=OWNER, job_ids=[a, b], delays=[10.0, 300.0], error_class="http_500", message="server error"
    )
    assert moved == {a: "retry", b: "retry"}
    for jid, delay in ((a, 10.0), (b, 300.0)):
        j = job(q, jid)
        assert (j.status, j.attempts) == ("retry", 1)  # the attempt is kept, not reset
        assert_about(j.available_in, delay)
        assert_no_lease(j)
        assert (j.error_class, j.error_message) == ("http_500", "server error")
        assert j.vector is None


def test_fail_retryable_exhausted_goes_to_failed(q):
    [jid] = seed(q, 1, max_attempts=2)
    hold(q, jid)
    assert job_helpers.fail_retryable(q, owner=OWNER, job_ids=[jid], delays=[0.0], error_class="e", message="1") == {
        jid: "retry"
    }
    hold(q, jid)
    assert job(q, jid).attempts == 2
    assert job_helpers.fail_retryable(
        q, owner=OWNER, job_ids=[jid], delays=[0.0], error_class="timeout", message="2"
    ) == {jid: "failed"}
    j = job(q, jid)
    assert (j.status, j.attempts, j.error_class) == ("failed", 2, "timeout")
    assert_no_lease(j)
    assert claim_ids(q) == []


def test_fail_retryable_refused_for_non_owner_and_non_processing(q):
    [jid] = seed(q, 1)
    assert job_helpers.fail_retryable(q, owner=OWNER, job_ids=[jid], delays=[0.0], error_class="e", message="m") == {}
    assert job(q, jid).status == "pending"
    hold(q, jid)
    assert job_helpers.fail_retryable(q, owner=OTHER, job_ids=[jid], delays=[0.0], error_class="e", message="m") == {}
    j = job(q, jid)
    assert (j.status, j.attempts, j.lease_owner, j.error_class) == ("processing", 1, OWNER, None)


# --------------------------------------------------------------------------- give_back


def test_give_back_first_attempt_to_pending(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    assert job_helpers.give_back(
        q, owner=OWNER, job_ids=[jid], delay=20.0, error_class="http_429", message="slow down"
    ) == [jid]
    j = job(q, jid)
    assert (j.status, j.attempts) == ("pending", 0)
    assert_about(j.available_in, 20.0)
    assert_no_lease(j)
    assert j.error_class == "http_429"


def test_give_back_later_attempt_to_retry(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    job_helpers.fail_retryable(q, owner=OWNER, job_ids=[jid], delays=[0.0], error_class="http_500", message="m")
    hold(q, jid)
    assert job(q, jid).attempts == 2
    assert job_helpers.give_back(q, owner=OWNER, job_ids=[jid]) == [jid]
    j = job(q, jid)
    assert (j.status, j.attempts) == ("retry", 1)
    assert_about(j.available_in, 0.0)
    assert_no_lease(j)
    assert j.error_class == "http_500"  # no new class given: the previous one is kept


def test_give_back_does_not_consume_attempts(q):
    [jid] = seed(q, 1, max_attempts=2)
    for _ in range(10):
        hold(q, jid)
        assert job_helpers.give_back(q, owner=OWNER, job_ids=[jid], error_class="http_429", message="m") == [jid]
    j = job(q, jid)
    assert (j.status, j.attempts) == ("pending", 0)


def test_give_back_refused_for_non_owner(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    assert job_helpers.give_back(q, owner=OTHER, job_ids=[jid]) == []
    j = job(q, jid)
    assert (j.status, j.attempts, j.lease_owner) == ("processing", 1, OWNER)


# --------------------------------------------------------------------------- fail_terminal


def test_fail_terminal_processing_to_failed(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    assert job_helpers.fail_terminal(q, owner=OWNER, job_ids=[jid], error_class="input_invalid", message="bad") == [jid]
    j = job(q, jid)
    assert (j.status, j.attempts, j.error_class, j.error_message) == ("failed", 1, "input_invalid", "bad")
    assert_no_lease(j)
    assert j.vector is None


@pytest.mark.parametrize("state", ["pending", "retry", "ready", "failed", "superseded"])
def test_fail_terminal_refused_for_non_processing(q, state):
    jid = to_state(q, state)
    before = job(q, jid)
    assert job_helpers.fail_terminal(q, owner=OWNER, job_ids=[jid], error_class="x", message="x") == []
    after = job(q, jid)
    assert (after.status, after.attempts, after.error_class) == (before.status, before.attempts, before.error_class)


def test_fail_terminal_refused_for_non_owner(q):
    [jid] = seed(q, 1)
    hold(q, jid)
    assert job_helpers.fail_terminal(q, owner=OTHER, job_ids=[jid], error_class="x", message="x") == []
    j = job(q, jid)
    assert (j.status, j.lease_owner, j.error_class) == ("processing", OWNER, None)


# --------------------------------------------------------------------------- extend_lease


def test_extend_lease_owner_only(q):
    [jid] = seed(q, 1)
    hold(q, jid, lease=5)
    assert_about(job(q, jid).lease_in, 5)

    assert transitions.extend_lease(q, owner=OTHER, job_ids=[jid], lease_seconds=600) == 0
    assert_about(job(q, jid).lease_in, 5)

    assert transitions.extend_lease(q, owner=OWNER, job_ids=[jid], lease_seconds=600) == 1
    j = job(q, jid)
    assert (j.status, j.lease_owner, j.attempts) == ("processing", OWNER, 1)
    assert_about(j.lease_in, 600)

    job_helpers.complete(q, owner=OWNER, job_ids=[jid], vectors=[vec(1)])
    assert transitions.extend_lease(q, owner=OWNER, job_ids=[jid], lease_seconds=600) == 0
    assert_no_lease(job(q, jid))


def test_jobs_of_a_retired_model_never_wait_for_a_worker(q):
    """After `models retire`, a rescued lease, a requeued dead letter and a missing
    vector all end superseded: no worker of that model will come for them."""
    held, dead, done = seed(q, 3)
    assert sorted(claim_ids(q)) == sorted([held, dead, done])
    job_helpers.fail_terminal(q, owner=OWNER, job_ids=[dead], error_class="bad_input", message="x")
    job_helpers.complete(q, owner=OWNER, job_ids=[done], vectors=[np.ones(4, dtype=np.float32)])
    models.retire(q, MODEL)
    q.execute("UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second' WHERE job_id = %s", (held,))
    assert transitions.rescue_expired(q) == {"retry": 0, "failed": 0, "superseded": 1}
    assert transitions.requeue_failed(q, [dead]) == {"pending": 0, "superseded": 1}
    q.execute("DELETE FROM app.embeddings")
    assert transitions.repair_missing_vectors(q) == 0
    assert claim_ids(q) == []


# --------------------------------------------------------------------------- rescue_expired


def test_rescue_expired(q):
    """A crash is the claim's transient fault: every job of a dead claim gets its attempt
    back and counts a fault, even with its attempts used up."""
    expired, exhausted, alive = seed(q, 3, max_attempts=1)
    q.execute("UPDATE app.embedding_jobs SET max_attempts = 5 WHERE job_id = %s", (expired,))
    assert sorted(claim_ids(q)) == sorted([expired, exhausted, alive])
    q.execute(
        "UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second' WHERE job_id = ANY(%s)",
        ([expired, exhausted],),
    )

    assert transitions.rescue_expired(q) == {"retry": 2, "failed": 0, "superseded": 0}

    for jid in (expired, exhausted):
        e = job(q, jid)
        assert (e.status, e.attempts, e.error_class) == ("pending", 0, "lease_expired")
        assert q.execute("SELECT faults FROM app.embedding_jobs WHERE job_id = %s", (jid,)).fetchone()[0] == 1
        assert_no_lease(e)
        assert_about(e.available_in, 0.0)
    a = job(q, alive)
    assert (a.status, a.lease_owner, a.error_class) == ("processing", OWNER, None)
    assert_about(a.lease_in, LEASE)

    assert transitions.rescue_expired(q) == {"retry": 0, "failed": 0, "superseded": 0}
    assert sorted(claim_ids(q, owner=OTHER)) == sorted([expired, exhausted])


@pytest.mark.parametrize(
    "faults, held_with, max_attempts, became, attempts",
    [
        (FREE_FAULTS - 1, None, 1, "pending", 0),  # alone but not yet a suspect: a fault
        (FREE_FAULTS, "claim", 1, "pending", 0),  # a suspect, but with another job in its claim: a fault
        (FREE_FAULTS, "process", 1, "pending", 0),  # ... or in another claim of its process: a fault
        (FREE_FAULTS, "other process", 2, "retry", 1),  # a suspect alone in its process: its attempt stays used
        (FREE_FAULTS, None, 1, "failed", 1),  # ... and failed when they are used up
    ],
)
def test_rescue_charges_only_a_suspect_alone_in_its_process(q, faults, held_with, max_attempts, became, attempts):
    """Lease owners are `worker/run/claim`: the rescue judges a job by all its process held."""
    jid, other = seed(q, 2, max_attempts=max_attempts)
    q.execute("UPDATE app.embedding_jobs SET faults = %s WHERE job_id = %s", (faults, jid))
    if held_with == "claim":
        assert sorted(claim_ids(q, owner="w/run/1")) == sorted([jid, other])
    else:
        hold(q, jid, owner="w/run/1")
        if held_with is not None:
            hold(q, other, owner="w/run/2" if held_with == "process" else "w/other-run/1")
    q.execute(
        "UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second' WHERE status = 'processing'"
    )
    transitions.rescue_expired(q)
    j = job(q, jid)
    charged = became != "pending"
    assert (j.status, j.attempts) == (became, attempts)
    assert q.execute("SELECT faults FROM app.embedding_jobs WHERE job_id = %s", (jid,)).fetchone()[0] == faults + (
        0 if charged else 1
    )


def test_a_job_the_rescue_would_charge_is_a_suspect_whatever_the_fault_evidence(q):
    """The worker's suspect and the rescue's charge agree: a job that met FREE_FAULTS faults,
    the last a crash, is a suspect even while the provider's failure rate raises the evidence
    threshold (a fresh process that has seen a few answers: 3-5), so its claim holds it alone
    and its next crash is charged. The same faults from the provider make no suspect there."""
    from pipeline_assets.jobqueue.decisions import alone_if_suspect, suspect
    from pipeline_assets.jobqueue.evidence import MAX_EVIDENCE_FAULTS

    poison, neighbour, flaky = seed(q, 3, max_attempts=3)
    q.execute("UPDATE app.embedding_jobs SET faults = %s WHERE job_id = %s", (FREE_FAULTS - 1, poison))
    q.execute(
        "UPDATE app.embedding_jobs SET faults = %s, error_class = 'timeout' WHERE job_id = %s", (FREE_FAULTS, flaky)
    )
    hide = "UPDATE app.embedding_jobs SET available_at = available_at {} interval '100 years' WHERE job_id = %s"
    q.execute(hide.format("+"), (flaky,))
    assert sorted(claim_ids(q, owner="w/run/1")) == sorted([poison, neighbour])
    q.execute(
        "UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second' WHERE status = 'processing'"
    )
    transitions.rescue_expired(q)  # held with a neighbour: a fault each, nobody charged
    q.execute(hide.format("-"), (flaky,))
    q.execute("UPDATE app.embedding_jobs SET available_at = now() - interval '1 second'")

    claimed = transitions.claim(q, model_id=MODEL, owner="w2/run/1", limit=10, lease_seconds=LEASE)
    by_id = {j.job_id: j for j in claimed}
    assert by_id[poison].faults == FREE_FAULTS and by_id[flaky].faults == FREE_FAULTS
    for threshold in range(1, MAX_EVIDENCE_FAULTS + 1):
        assert suspect(by_id[poison], threshold), threshold
        assert suspect(by_id[flaky], threshold) == (threshold == 1), threshold
    kept, back = alone_if_suspect(sorted(claimed, key=lambda j: j.job_id != poison), MAX_EVIDENCE_FAULTS)
    assert [j.job_id for j in kept] == [poison]
    q.execute(
        "UPDATE app.embedding_jobs SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL"
        " WHERE job_id = ANY(%s)",
        ([j.job_id for j in back],),
    )
    q.execute(
        "UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second' WHERE status = 'processing'"
    )
    transitions.rescue_expired(q)  # alone in its process: charged
    assert q.execute("SELECT attempts, faults FROM app.embedding_jobs WHERE job_id = %s", (poison,)).fetchone() == (
        1,
        FREE_FAULTS,
    )


# --------------------------------------------------------------------------- requeue_failed


def test_requeue_failed_by_ids(q):
    wanted = to_state(q, "failed")
    unwanted = to_state(q, "failed")
    untouched_failed = to_state(q, "failed")
    others = {s: to_state(q, s) for s in ("pending", "processing", "retry", "ready", "superseded")}
    drop_chunks(q, unwanted)
    before = {s: job(q, i) for s, i in others.items()}

    counts = transitions.requeue_failed(q, [wanted, unwanted, *others.values()])
    assert counts == {"pending": 1, "superseded": 1}

    w = job(q, wanted)
    assert (w.status, w.attempts) == ("pending", 0)
    assert_about(w.available_in, 0.0)
    assert_no_lease(w)
    u = job(q, unwanted)
    assert (u.status, u.attempts, u.vector) == ("superseded", 0, None)
    assert job(q, untouched_failed).status == "failed"
    for s, i in others.items():
        after = job(q, i)
        assert (after.status, after.attempts, after.lease_owner) == (s, before[s].attempts, before[s].lease_owner)

    # The requeued job is claimable again (alongside the pending and retry ones that always were).
    assert set(claim_ids(q, owner=OTHER)) == {wanted, others["pending"], others["retry"]}


def test_requeue_all_failed(q):
    a = to_state(q, "failed")
    b = to_state(q, "failed")
    gone = to_state(q, "failed")
    ready = to_state(q, "ready")
    drop_chunks(q, gone)
    assert transitions.requeue_failed(q, all_failed=True) == {"pending": 2, "superseded": 1}
    assert [job(q, i).status for i in (a, b, gone, ready)] == ["pending", "pending", "superseded", "ready"]
    assert transitions.requeue_failed(q, all_failed=True) == {"pending": 0, "superseded": 0}


# --------------------------------------------------------------------------- supersede_unwanted


def test_supersede_unwanted_from_every_live_state(q):
    ids = {s: to_state(q, s) for s in ("pending", "retry", "processing", "ready", "failed")}
    assert job(q, ids["ready"]).vector is not None
    for jid in ids.values():
        drop_chunks(q, jid)

    assert transitions.supersede_unwanted(q) == 5
    for s, jid in ids.items():
        j = job(q, jid)
        assert j.status == "superseded", s
        assert_no_lease(j)
        assert j.vector is None, s
    assert q.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 0
    # The former lease holder can no longer complete it.
    assert job_helpers.complete(q, owner=OWNER, job_ids=[ids["processing"]], vectors=[vec(1)]) == ([], [])
    assert job(q, ids["processing"]).vector is None
    assert transitions.supersede_unwanted(q) == 0


def test_supersede_unwanted_keeps_content_carried_by_another_document(q):
    [shared] = seed(q, 1, labels=["shared"])
    doc1 = q.execute("SELECT doc_pk FROM app.chunks WHERE chunk_checksum = %s", (checksum("shared"),)).fetchone()[0]
    doc2 = add_document(q)
    add_chunks(q, doc2, [checksum("shared")])
    hold(q, shared)
    job_helpers.complete(q, owner=OWNER, job_ids=[shared], vectors=[vec(4)])

    q.execute("DELETE FROM app.chunks WHERE doc_pk = %s", (doc1,))
    assert transitions.supersede_unwanted(q) == 0
    assert transitions.supersede_unwanted(q, [checksum("shared")]) == 0
    j = job(q, shared)
    assert j.status == "ready"
    np.testing.assert_allclose(j.vector, vec(4))


def test_supersede_unwanted_with_checksum_filter(q):
    a, b, kept = seed(q, 3, labels=["fa", "fb", "fkept"])
    drop_chunks(q, a)
    drop_chunks(q, b)

    assert transitions.supersede_unwanted(q, [checksum("fa"), checksum("fkept")]) == 1
    assert [job(q, i).status for i in (a, b, kept)] == ["superseded", "pending", "pending"]
    assert transitions.supersede_unwanted(q, []) == 0
    assert transitions.supersede_unwanted(q) == 1
    assert [job(q, i).status for i in (a, b, kept)] == ["superseded", "superseded", "pending"]


# --------------------------------------------------------------------------- revive_wanted


def test_revive_wanted(q):
    back = to_state(q, "superseded")  # to_state restores a chunk: wanted again
    still_gone = to_state(q, "superseded")
    drop_chunks(q, still_gone)
    q.execute("UPDATE app.embedding_jobs SET error_class = 'old', attempts = 3 WHERE job_id = %s", (back,))

    assert transitions.revive_wanted(q) == 1
    j = job(q, back)
    assert (j.status, j.attempts, j.error_class, j.error_message) == ("pending", 0, None, None)
    assert_about(j.available_in, 0.0)
    assert_no_lease(j)
    assert j.vector is None
    assert job(q, still_gone).status == "superseded"
    assert transitions.revive_wanted(q) == 0
    assert claim_ids(q) == [back]


def test_revive_wanted_with_checksum_filter(q):
    a = to_state(q, "superseded")
    b = to_state(q, "superseded")
    assert transitions.revive_wanted(q, [checksum_of(q, b)]) == 1
    assert (job(q, a).status, job(q, b).status) == ("superseded", "pending")


def test_revive_does_not_touch_live_jobs(q):
    ids = {s: to_state(q, s) for s in ("pending", "retry", "processing", "ready", "failed")}
    assert transitions.revive_wanted(q) == 0
    assert {s: job(q, i).status for s, i in ids.items()} == {s: s for s in ids}


# --------------------------------------------------------------------------- repair_missing_vectors


def test_repair_missing_vectors(q):
    lost = to_state(q, "ready")
    fine = to_state(q, "ready")
    q.execute("DELETE FROM app.embeddings WHERE chunk_checksum = %s", (checksum_of(q, lost),))

    assert transitions.repair_missing_vectors(q) == 1
    j = job(q, lost)
    assert (j.status, j.attempts, j.vector) == ("pending", 0, None)
    assert_about(j.available_in, 0.0)
    f = job(q, fine)
    assert f.status == "ready" and f.vector is not None
    assert transitions.repair_missing_vectors(q) == 0


# --------------------------------------------------------------------------- enqueue


def test_enqueue_for_docs_idempotent(q):
    doc = add_document(q)
    add_chunks(q, doc, [checksum("e1"), checksum("e2"), checksum("e1")])  # a repeated chunk is one job
    assert transitions.enqueue_for_docs(q, [doc], 5) == 2
    assert transitions.enqueue_for_docs(q, [doc], 5) == 0
    assert transitions.enqueue_missing(q, 5) == 0
    rows = q.execute("SELECT status, attempts, max_attempts FROM app.embedding_jobs").fetchall()
    assert sorted(rows) == [("pending", 0, 5), ("pending", 0, 5)]
    assert transitions.enqueue_for_docs(q, [], 5) == 0


def test_enqueue_for_docs_one_job_per_active_model(q):
    models.ensure_model(q, SPEC2)
    doc = add_document(q)
    add_chunks(q, doc, [checksum("two-models")])
    assert transitions.enqueue_for_docs(q, [doc], 5) == 2
    q.execute("UPDATE app.models SET active = false WHERE model_id = %s", (MODEL2,))
    doc2 = add_document(q)
    add_chunks(q, doc2, [checksum("one-model")])
    assert transitions.enqueue_for_docs(q, [doc2], 5) == 1


def test_enqueue_missing_idempotent(q):
    doc = add_document(q)
    add_chunks(q, doc, [checksum("m1"), checksum("m2")])
    assert transitions.enqueue_missing(q, 7) == 2
    assert transitions.enqueue_missing(q, 7) == 0
    assert transitions.enqueue_for_docs(q, [doc], 7) == 0
    other = add_document(q)
    add_chunks(q, other, [checksum("m1"), checksum("m3")])
    assert transitions.enqueue_missing(q, 7) == 1
    assert transitions.enqueue_missing(q, 7) == 0
    assert q.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0] == 3


def test_enqueue_leaves_existing_jobs_alone(q):
    """A job already exists in any state: enqueue inserts nothing and changes nothing (revive is the way back)."""
    ids = {s: to_state(q, s) for s in STATES}
    before = {s: job(q, i) for s, i in ids.items()}
    docs = [r[0] for r in q.execute("SELECT doc_pk FROM app.documents")]
    assert transitions.enqueue_for_docs(q, docs, 5) == 0
    assert transitions.enqueue_missing(q, 5) == 0
    for s, i in ids.items():
        after = job(q, i)
        assert (after.status, after.attempts) == (before[s].status, before[s].attempts)


def test_unique_constraint_rejects_duplicate_job(q):
    [_jid] = seed(q, 1, labels=["dup"])
    # The identity lives in app.job_keys (written once; the state row stays narrow).
    with pytest.raises(psycopg.errors.UniqueViolation):
        q.execute(
            "INSERT INTO app.job_keys (chunk_checksum, model_id, job_id) VALUES (%s, %s, -1)", (checksum("dup"), MODEL)
        )
    assert q.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0] == 1


# --------------------------------------------------------------------------- the transition table

# Every edge the state machine allows, as data: operation -> {from: to}, each
# under the condition named in CONTEXT. Every (operation, from) pair missing
# from its map is a refused edge: the operation moves nothing.
EDGES: dict[str, dict[str, str]] = {
    "claim": {"pending": "processing", "retry": "processing"},
    "complete": {"processing": "ready"},
    "complete/content_gone": {"processing": "superseded"},
    "fail_retryable": {"processing": "retry"},
    "fail_retryable/exhausted": {"processing": "failed"},
    "give_back/first_attempt": {"processing": "pending"},
    "give_back/later_attempt": {"processing": "retry"},
    "fail_terminal": {"processing": "failed"},
    "rescue_expired/first_attempt": {"processing": "pending"},
    "rescue_expired": {"processing": "retry"},
    "rescue_expired/exhausted": {"processing": "failed"},
    "requeue_failed": {"failed": "pending"},
    "requeue_failed/content_gone": {"failed": "superseded"},
    "supersede_unwanted": {s: "superseded" for s in ("pending", "retry", "processing", "ready", "failed")},
    "revive_wanted": {"superseded": "pending"},
    "repair_missing_vectors": {"ready": "pending"},
}

# The conditions most favourable to each operation, applied to the job after it
# reached its state (so a refusal is due to the state alone).
CONTEXT: dict[str, dict] = {
    "complete/content_gone": {"wanted": False},
    "fail_retryable/exhausted": {"attempts": "max"},
    "give_back/first_attempt": {"attempts": 1},
    "give_back/later_attempt": {"attempts": 2},
    "rescue_expired/first_attempt": {"expired": True},
    "rescue_expired": {"expired": True, "attempts": 2},
    "rescue_expired/exhausted": {"expired": True, "attempts": "max", "faults": FREE_FAULTS},
    "requeue_failed/content_gone": {"wanted": False},
    "supersede_unwanted": {"wanted": False},
    "repair_missing_vectors": {"drop_vectors": True},
}


def apply(conn, op: str, jid: int) -> int:
    """Run one operation against job ``jid`` as its (former) owner; return how many jobs it moved."""
    name = op.split("/")[0]
    if name == "claim":
        return len(claim_ids(conn, owner=OTHER))
    if name == "complete":
        ready, superseded = job_helpers.complete(conn, owner=OWNER, job_ids=[jid], vectors=[vec(5)])
        return len(ready) + len(superseded)
    if name == "fail_retryable":
        return len(
            job_helpers.fail_retryable(conn, owner=OWNER, job_ids=[jid], delays=[0.0], error_class="e", message="m")
        )
    if name == "give_back":
        return len(job_helpers.give_back(conn, owner=OWNER, job_ids=[jid]))
    if name == "fail_terminal":
        return len(job_helpers.fail_terminal(conn, owner=OWNER, job_ids=[jid], error_class="e", message="m"))
    if name == "rescue_expired":
        return sum(transitions.rescue_expired(conn).values())
    if name == "requeue_failed":
        return sum(transitions.requeue_failed(conn, [jid]).values())
    if name == "supersede_unwanted":
        return transitions.supersede_unwanted(conn)
    if name == "revive_wanted":
        return transitions.revive_wanted(conn)
    if name == "repair_missing_vectors":
        return transitions.repair_missing_vectors(conn)
    raise ValueError(op)


def test_edge_table_is_complete():
    names = {op.split("/")[0] for op in EDGES}
    assert names == {
        "claim",
        "complete",
        "fail_retryable",
        "give_back",
        "fail_terminal",
        "rescue_expired",
        "requeue_failed",
        "supersede_unwanted",
        "revive_wanted",
        "repair_missing_vectors",
    }
    targets = {(src, dst) for edges in EDGES.values() for src, dst in edges.items()}
    assert all(dst in STATES and src in STATES for src, dst in targets)
    assert set(CONTEXT) <= set(EDGES)


@pytest.mark.parametrize("op", list(EDGES))
def test_transition_table(q, op):
    """For one operation, every state: allowed edges move exactly as listed, refused ones move nothing."""
    ctx = CONTEXT.get(op, {})
    for state in STATES:
        # Each state gets a fresh job in an otherwise empty queue (global operations see only it).
        q.execute("TRUNCATE app.embedding_jobs, app.job_keys, app.embeddings, app.chunks")
        jid = to_state(q, state, max_attempts=3)
        if not ctx.get("wanted", True):
            drop_chunks(q, jid)
        if "attempts" in ctx:
            q.execute(
                "UPDATE app.embedding_jobs SET attempts = %s WHERE job_id = %s",
                (3 if ctx["attempts"] == "max" else ctx["attempts"], jid),
            )
        if "faults" in ctx:
            q.execute("UPDATE app.embedding_jobs SET faults = %s WHERE job_id = %s", (ctx["faults"], jid))
        if ctx.get("expired"):
            q.execute("UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second'")
        if ctx.get("drop_vectors"):
            q.execute("DELETE FROM app.embeddings")
        before = job(q, jid)

        moved = apply(q, op, jid)
        after = job(q, jid)
        expected = EDGES[op].get(state)
        if expected is None:
            assert moved == 0, f"{op}: {state} must be refused"
            assert (after.status, after.attempts, after.lease_owner) == (
                before.status,
                before.attempts,
                before.lease_owner,
            ), f"{op}: {state} changed"
        else:
            assert moved == 1, f"{op}: {state} -> {expected} did not move"
            assert after.status == expected, f"{op}: {state} -> {after.status}, expected {expected}"
            if expected != "processing":
                assert_no_lease(after)
            if expected != "ready":
                assert after.vector is None, f"{op}: {state} -> {expected} left a vector"


# --------------------------------------------------------------------------- concurrent supersede


def wait_until_blocked(conn, pid: int, thread: threading.Thread, timeout: float = 60.0) -> None:
    """Wait until backend ``pid`` waits for a lock (or its thread already finished without waiting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and thread.is_alive():
        if conn.execute("SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)).fetchone():
            return
        time.sleep(0.01)
    if thread.is_alive():
        raise AssertionError(f"backend {pid} neither blocked on a lock nor finished")


def test_supersede_unwanted_racing_a_completion_deletes_its_vector(q, database_url):
    """A completion and an ingest that drops the content overlap; the job ends superseded WITHOUT a vector.

    Interleaving (what ingest.py and worker.py really do): the worker's transaction
    completes the job (row locked, vector inserted, not yet committed); an ingest
    transaction deletes the chunk and runs supersede_unwanted, which blocks on the
    job row; the worker commits; supersede_unwanted re-checks the row, finds it
    ready and unwanted, supersedes it -- and must delete the vector with it
    ("a vector row exists exactly while its job is ready").
    """
    [jid] = seed(q, 1)
    hold(q, jid)
    result: dict[str, object] = {}
    with db.connect(database_url) as worker, db.connect(database_url) as ingest:

        def run_ingest() -> None:
            try:
                with ingest.transaction():
                    drop_chunks(ingest, jid)
                    result["superseded"] = transitions.supersede_unwanted(ingest)
            except BaseException as exc:  # surfaced below
                result["error"] = exc

        with worker.transaction():
            assert job_helpers.complete(worker, owner=OWNER, job_ids=[jid], vectors=[vec(1)]) == ([jid], [])
            t = threading.Thread(target=run_ingest)
            t.start()
            wait_until_blocked(q, ingest.info.backend_pid, t)
        t.join(timeout=60)
    assert "error" not in result, result
    assert result["superseded"] == 1
    j = job(q, jid)
    assert j.status == "superseded"
    assert j.vector is None, "superseded job kept its vector: SUPERSEDE_UNWANTED missed the concurrently stored row"
