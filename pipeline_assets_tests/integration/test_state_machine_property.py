"""The job state machine under hypothesis: random interleavings of every transition.

A ``RuleBasedStateMachine`` drives ``pipeline_assets.jobqueue.transitions``, ``registry.models`` and
``app.model_admin.reactivate`` against the real PostgreSQL as workers, ingest, reconcile and a person
would: claim, complete (by the lease holder or a stale owner), expire a lease, rescue, give back, fail
(retryable, terminal), throttle, drop and restore a chunk, retire and reactivate a model, requeue the
dead letter, and move the clock (timestamps into the past; nothing sleeps). Each rule checks its own
effect against the rows read just before it; after every rule the invariants of ``check`` hold; the
drain rule (and every teardown) leaves every wanted (checksum, active model) ``ready`` or ``failed``.
Normal run: a fixed seed, 50 examples of up to 50 steps. ``PIPELINE_TEST_PROFILE=long``: 600 examples
of up to 120 steps, randomly seeded. A failure prints its steps and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pipeline_assets.app import model_admin
from pipeline_assets.jobqueue import decisions, outcomes, provider_state, request_plan, transitions
from pipeline_assets.jobqueue.breaker_config import BREAKER_THRESHOLD
from pipeline_assets.jobqueue.changes import ClaimedJob
from pipeline_assets.providers import RETRYABLE, ModelSpec, ProviderError
from pipeline_assets.providers.base import BAD_RESPONSE
from pipeline_assets.registry import models
from pipeline_assets_tests import job_helpers
from pipeline_assets_tests.conftest import LONG_PROFILE

_COMMON = dict(
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The default profile is sized to the suite's time budget; the long one explores.
settings.register_profile(
    "pipeline-jobs-default", max_examples=50, stateful_step_count=50, derandomize=False, **_COMMON
)
settings.register_profile("pipeline-jobs-long", max_examples=600, stateful_step_count=120, derandomize=False, **_COMMON)
PROFILE = "pipeline-jobs-long" if LONG_PROFILE else "pipeline-jobs-default"

SPECS = [
    ModelSpec(provider="prop", name=name, dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000)
    for name in ("m1", "m2")
]
MODELS = [s.model_id for s in SPECS]
LABELS = [f"c{i}" for i in range(6)]  # the content pool: one checksum per label
SUMS = [hashlib.sha256(label.encode()).digest() for label in LABELS]
DOCS = 3
# (doc, label): c2 and c3 are shared by two documents, c5 is wanted by nobody yet
INITIAL = {(0, 0), (0, 1), (0, 2), (1, 2), (1, 3), (1, 4), (2, 3)}
MAX_ATTEMPTS = 3
LEASE = 3600.0  # a lease never expires by itself during an example: expire_lease does it
FAR = 3600.0  # a delay that is "later" until the clock is moved forward
ALL_TABLES = """app.sources, app.documents, app.chunks, app.embedding_jobs, app.job_keys, app.embeddings,
                app.stage_runs, app.provider_state, app.provider_calls, app.input_sends_until_032, app.workers,
                app.models"""

STATE_COLUMNS = (
    "job_id",
    "chunk_checksum",
    "model_id",
    "status",
    "attempts",
    "max_attempts",
    "lease_owner",
    "leased",
    "expired",
    "available",
    "available_far",
    "throttles",
    "faults",
)


@dataclass(frozen=True)
class Row:
    job_id: int
    chunk_checksum: bytes
    model_id: str
    status: str
    attempts: int
    max_attempts: int
    lease_owner: str | None
    leased: bool  # lease_expires_at IS NOT NULL
    expired: bool | None  # lease_expires_at < now()
    available: bool  # available_at <= now()
    available_far: bool  # available_at > now() + FAR/2: a long delay was applied
    throttles: int
    faults: int  # transient faults charged to its requests instead of to it


@dataclass
class Claim:
    owner: str
    model_id: str
    job_ids: list[int]
    probe: bool
    late: bool = False  # it already tried a late completion


class JobStateMachine(RuleBasedStateMachine):
    conn = None  # set by the test from its fixture
    # "Jobs of a retired model never wait for a worker": rescue, requeue, give_back and
    # fail_retryable all supersede a job whose model was retired meanwhile.
    check_retired_queue = True

    def __init__(self) -> None:
        super().__init__()
        c = self.conn
        c.execute(f"TRUNCATE {ALL_TABLES} CASCADE")
        for spec in SPECS:
            models.ensure_model(c, spec)
        source = c.execute("INSERT INTO app.sources (root) VALUES ('/prop') RETURNING source_id").fetchone()[0]
        self.doc_pks = [
            c.execute(
                "INSERT INTO app.documents (source_id, document_id, source_uri, status)"
                " VALUES (%s, %s, %s, 'current') RETURNING doc_pk",
                (source, f"d{d}", f"file:///d{d}"),
            ).fetchone()[0]
            for d in range(DOCS)
        ]
        self.members: set[tuple[int, int]] = set()
        for doc, label in sorted(INITIAL):
            self._insert_chunk(doc, label)
        transitions.enqueue_for_docs(c, self.doc_pks, MAX_ATTEMPTS)
        self.active = {m: True for m in MODELS}
        self.claims: list[Claim] = []
        self.expected_vectors: dict[tuple[bytes, str], np.ndarray] = {}
        self._seq = itertools.count(1)
        self.drains = 0  # explicit drains so far: few, so that most steps work on a busy queue
        self._observe()

    # ------------------------------------------------------------------ helpers
    def _insert_chunk(self, doc: int, label: int) -> None:
        self.conn.execute(
            "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end)"
            " VALUES (%s, %s, %s, %s, 3, 0, 10)",
            (self.doc_pks[doc], label, SUMS[label], f"text of {LABELS[label]}"),
        )
        self.members.add((doc, label))

    def _rows(self) -> dict[int, Row]:
        rows = self.conn.execute(f"""
            SELECT job_id, chunk_checksum, model_id, status, attempts, max_attempts, lease_owner,
                   lease_expires_at IS NOT NULL, lease_expires_at < now(), available_at <= now(),
                   available_at > now() + make_interval(secs => {FAR / 2}), throttles, faults
            FROM app.embedding_jobs ORDER BY job_id""").fetchall()
        return {r[0]: Row(*r) for r in rows}

    def _vectors(self) -> dict[tuple[bytes, str], np.ndarray]:
        return {
            (s, m): np.asarray(v.to_numpy())
            for s, m, v in self.conn.execute("SELECT chunk_checksum, model_id, embedding FROM app.embeddings")
        }

    def _wanted_sums(self) -> set[bytes]:
        return {SUMS[label] for _, label in self.members}

    def _held(self, claim: Claim, rows: dict[int, Row]) -> list[int]:
        return [i for i in claim.job_ids if rows[i].status == "processing" and rows[i].lease_owner == claim.owner]

    # Preconditions read ``self.seen``: the rows as the invariant last read them, which
    # is the state every rule starts from (no query per rule per step).
    def _observe(self) -> None:
        self.seen = self._rows()
        self.breaker_waits = self.conn.execute(
            "SELECT EXISTS (SELECT 1 FROM app.provider_state"
            " WHERE tripped AND (paused_until > now() OR probe_until > now()))"
        ).fetchone()[0]

    def _live_claims(self) -> list[Claim]:
        held = {r.lease_owner for r in self.seen.values() if r.status == "processing"}
        return [c for c in self.claims if c.owner in held]

    @staticmethod
    def _by_content(rows: dict[int, Row]) -> list[Row]:
        """Rows in an order of their content, not of their job ids (see test_job_state_machine)."""
        return sorted(rows.values(), key=lambda r: (r.model_id, r.chunk_checksum))

    def _any(self, predicate) -> bool:
        return any(predicate(r) for r in self.seen.values())

    def _stale_claims(self) -> list[tuple[Claim, list[int]]]:
        """Claims that lost a lease and have not yet completed late."""
        rows = self.seen
        out = []
        for c in self.claims:
            lost = [i for i in c.job_ids if not (rows[i].status == "processing" and rows[i].lease_owner == c.owner)]
            if lost and not c.late:
                out.append((c, lost))
        return out

    def _vector(self) -> np.ndarray:
        n = next(self._seq)
        return np.array([n, n / 2, -n, 1.0], dtype=np.float32)

    def _owner(self) -> str:
        n = next(self._seq)
        return f"prop-worker-{n % 2}/{n}"  # claims of two worker processes

    def _assert_unchanged(self, before: dict[int, Row], after: dict[int, Row], ids, what: str) -> None:
        for i in ids:
            assert after[i] == before[i], f"{what}: job {i} changed {before[i]} -> {after[i]}"

    def _after_provider_success(self, claim: Claim) -> None:
        """What a worker does after an answer: close the breaker; free a probe slot."""
        provider_state.provider_healthy(self.conn, claim.model_id)
        if claim.probe:
            provider_state.release_probe(self.conn, claim.model_id, claim.owner)

    # ------------------------------------------------------------------ claim
    def _claim(self, model: str, limit: int) -> Claim | None:
        c = self.conn
        owner = self._owner()
        with c.transaction():  # one now() for the oracle and the claim
            active, tripped, pause_over, probe_free = c.execute(
                """
                SELECT m.active, coalesce(p.tripped, false), coalesce(p.paused_until <= now(), true),
                       coalesce(p.probe_until <= now(), true)
                FROM app.models m LEFT JOIN app.provider_state p USING (model_id)
                WHERE m.model_id = %s""",
                (model,),
            ).fetchone()
            waiting = [
                r[0]
                for r in c.execute(
                    """
                SELECT job_id FROM app.embedding_jobs
                WHERE model_id = %s AND status IN ('pending', 'retry') AND available_at <= now()
                ORDER BY available_at, job_id""",
                    (model,),
                )
            ]
            before = self._rows()
            jobs = transitions.claim(c, model_id=model, owner=owner, limit=limit, lease_seconds=LEASE)
        if not jobs:  # as JobStore.claim: an empty claim frees a probe slot it took
            provider_state.release_probe(c, model, owner)
        if not active or (tripped and not (pause_over and probe_free)):
            expected, probe = [], False
        else:
            expected, probe = waiting[:limit], tripped
        got = sorted(j.job_id for j in jobs)
        assert got == sorted(expected), f"claim({model}, {limit}) took {got}, expected {sorted(expected)}"
        after = self._rows()
        for j in jobs:
            assert j.probe == probe, f"claim probe flag {j.probe}, expected {probe}"
            assert j.attempts == before[j.job_id].attempts + 1
            assert j.text is not None, f"claimed job {j.job_id} has no current chunk"
            r = after[j.job_id]
            assert (r.status, r.lease_owner, r.leased, r.attempts) == ("processing", owner, True, j.attempts)
        self._assert_unchanged(before, after, set(before) - set(got), "claim")
        if not jobs:
            return None
        claim = Claim(owner, model, got, probe)
        self.claims.append(claim)
        return claim

    @rule(model=st.sampled_from(MODELS), limit=st.integers(1, 4))
    def claim(self, model, limit):
        self._claim(model, limit)

    # ------------------------------------------------------------------ complete
    @precondition(lambda self: self._live_claims())
    @rule(pick=st.integers(0, 10**6))
    def complete_by_lease_holder(self, pick):
        live = self._live_claims()
        claim = live[pick % len(live)]
        self._complete(claim)

    def _complete(self, claim: Claim) -> None:
        c = self.conn
        before, vectors_before = self._rows(), self._vectors()
        held = self._held(claim, before)
        vecs = {i: self._vector() for i in claim.job_ids}
        wanted = self._wanted_sums()
        ready, superseded = job_helpers.complete(
            c, owner=claim.owner, job_ids=claim.job_ids, vectors=[vecs[i] for i in claim.job_ids]
        )
        expect_ready = {i for i in held if before[i].chunk_checksum in wanted and self.active[before[i].model_id]}
        assert set(ready) == expect_ready, f"complete: ready {sorted(ready)}, expected {sorted(expect_ready)}"
        assert set(superseded) == set(held) - expect_ready, f"complete: superseded {sorted(superseded)}"
        after, vectors_after = self._rows(), self._vectors()
        for i in ready:
            r = after[i]
            assert (r.status, r.lease_owner, r.leased, r.attempts) == ("ready", None, False, before[i].attempts)
            key = (r.chunk_checksum, r.model_id)
            assert np.array_equal(vectors_after[key], vecs[i])
            self.expected_vectors[key] = vecs[i]
        for i in superseded:
            r = after[i]
            assert (r.status, r.lease_owner, r.leased) == ("superseded", None, False)
            assert (r.chunk_checksum, r.model_id) not in vectors_after
        lost = set(claim.job_ids) - set(held)
        self._assert_unchanged(before, after, lost, "complete of jobs whose lease was lost")
        for i in lost:
            key = (before[i].chunk_checksum, before[i].model_id)
            assert (key in vectors_after) == (key in vectors_before)
            if key in vectors_after:
                assert np.array_equal(vectors_after[key], vectors_before[key]), "a stale completion wrote a vector"
        self._after_provider_success(claim)

    @precondition(lambda self: self._stale_claims())
    @rule(pick=st.integers(0, 10**6))
    def complete_by_stale_owner(self, pick):
        """An owner whose lease is gone (rescued, superseded, given back, completed)
        completes late: it wins nothing and leaves no vector."""
        stale = self._stale_claims()
        claim, lost = stale[pick % len(stale)]
        claim.late = True
        before, vectors_before = self._rows(), self._vectors()
        result = job_helpers.complete(
            self.conn, owner=claim.owner, job_ids=lost, vectors=[self._vector() for _ in lost]
        )
        assert result == ([], []), f"stale owner {claim.owner} won {result}"
        after, vectors_after = self._rows(), self._vectors()
        assert after == before, "a stale completion changed job rows"
        assert vectors_after.keys() == vectors_before.keys()
        for key, v in vectors_after.items():
            assert np.array_equal(v, vectors_before[key]), "a stale completion overwrote a vector"

    # ------------------------------------------------------------------ failures
    def _pick_live(self, pick: int) -> tuple[Claim, dict[int, Row], list[int]]:
        live = self._live_claims()
        claim = live[pick % len(live)]
        before = self._rows()
        return claim, before, self._held(claim, before)

    @precondition(lambda self: self._live_claims())
    @rule(pick=st.integers(0, 10**6), far=st.booleans())
    def fail_retryable(self, pick, far):
        claim, before, held = self._pick_live(pick)
        # As the worker after a 5xx: count a provider failure (it trips the breaker
        # after BREAKER_THRESHOLD in a row), then move the jobs.
        provider_state.provider_failure(
            self.conn, claim.model_id, trip=False, floor=0.0, base=0.0, cap=0.0, threshold=BREAKER_THRESHOLD
        )
        moved = job_helpers.fail_retryable(
            self.conn,
            owner=claim.owner,
            job_ids=claim.job_ids,
            delays=[FAR if far else 0.0] * len(claim.job_ids),
            error_class="server_error",
            message="HTTP 500",
        )
        expected = {
            i: "superseded"
            if not self.active[before[i].model_id]
            else "failed"
            if before[i].attempts >= before[i].max_attempts
            else "retry"
            for i in held
        }
        assert moved == expected, f"fail_retryable moved {moved}, expected {expected}"
        after = self._rows()
        for i in held:
            r = after[i]
            assert (r.status, r.lease_owner, r.leased, r.attempts) == (expected[i], None, False, before[i].attempts)
            if expected[i] != "superseded":
                assert r.available_far == far and r.available != far
        self._assert_unchanged(before, after, set(before) - set(held), "fail_retryable")
        if claim.probe:
            provider_state.release_probe(self.conn, claim.model_id, claim.owner)

    @precondition(lambda self: self._live_claims())
    @rule(pick=st.integers(0, 10**6))
    def fail_terminal(self, pick):
        claim, before, held = self._pick_live(pick)
        moved = job_helpers.fail_terminal(
            self.conn, owner=claim.owner, job_ids=claim.job_ids, error_class="bad_input", message="HTTP 400"
        )
        assert sorted(moved) == sorted(held)
        after = self._rows()
        for i in held:
            assert (after[i].status, after[i].lease_owner, after[i].attempts) == ("failed", None, before[i].attempts)
        self._assert_unchanged(before, after, set(before) - set(held), "fail_terminal")
        if claim.probe:
            provider_state.release_probe(self.conn, claim.model_id, claim.owner)

    def _give_back(self, pick: int, delay: float, throttled: bool) -> None:
        claim, before, held = self._pick_live(pick)
        if throttled:  # as the worker after a 429: trip the shared breaker for the Retry-After
            job_helpers.pause_provider(self.conn, claim.model_id, delay)
        moved = job_helpers.give_back(
            self.conn,
            owner=claim.owner,
            job_ids=claim.job_ids,
            delay=delay,
            error_class="rate_limited" if throttled else None,
            throttled=throttled,
        )
        assert sorted(moved) == sorted(held)
        after = self._rows()
        for i in held:
            b, r = before[i], after[i]
            status = (
                "superseded"
                if not self.active[b.model_id]  # nobody may claim it again
                else "pending"
                if b.attempts <= 1
                else "retry"
            )
            assert (r.status, r.lease_owner, r.leased) == (status, None, False)
            assert r.attempts == max(b.attempts - 1, 0), "a give-back used an attempt"
            assert r.throttles == b.throttles + (1 if throttled else 0)
            if status != "superseded":
                assert r.available_far == (delay >= FAR) and r.available == (delay == 0)
        self._assert_unchanged(before, after, set(before) - set(held), "give_back")
        if claim.probe:
            provider_state.release_probe(self.conn, claim.model_id, claim.owner)

    @precondition(lambda self: self._live_claims())
    @rule(pick=st.integers(0, 10**6))
    def give_back(self, pick):
        self._give_back(pick, 0.0, throttled=False)

    @precondition(lambda self: self._live_claims())
    @rule(pick=st.integers(0, 10**6), delay=st.sampled_from([0.0, FAR]))
    def throttle(self, pick, delay):
        self._give_back(pick, delay, throttled=True)

    @precondition(lambda self: self._live_claims())
    @rule(
        pick=st.integers(0, 10**6),
        short=st.booleans(),
        unmatched=st.integers(0, 1),
        health=st.sampled_from([decisions.ANSWERS, decisions.DOWN, decisions.UNUSABLE]),
    )
    def unusable_answer(self, pick, short, unmatched, health):
        """As the worker after a dropped answer (the connection cut after billing) or a short
        one (an embedding missing), with the provider answering others or not: the real
        decision, applied by the real queue. No vector is stored; while the provider answers
        others the failure costs no attempt unless the job failed alone past its free faults
        (then it is a retry), and counts a fault; otherwise it costs nothing."""
        claim, before, held = self._pick_live(pick)
        jobs = [
            ClaimedJob(
                i, before[i].chunk_checksum, before[i].attempts, before[i].max_attempts, "t", faults=before[i].faults
            )
            for i in held
        ]
        if not jobs:
            return
        error = (
            ProviderError(RETRYABLE, BAD_RESPONSE, f"expected {len(jobs)} vectors, got 0")
            if short
            else ProviderError(RETRYABLE, "connection", "connection error", billed_maybe=True)
        )
        outcome = decisions.decide(
            error, jobs, config_ok=True, base=0.0, cap=0.0, poll_seconds=0.0, health=health, unusable_in_a_row=unmatched
        )
        vectors = self._vectors()
        if isinstance(outcome, outcomes.Stop):  # too many unusable answers: handed back untouched
            assert health == decisions.UNUSABLE and unmatched + 1 >= decisions.MAX_UNMATCHED_ANSWERS
            return
        applied = transitions.became(transitions.apply(self.conn, claim.owner, outcome.changes))
        after = self._rows()
        counted = health == decisions.ANSWERS
        charged = counted and len(jobs) == 1 and jobs[0].faults >= request_plan.FREE_FAULTS
        for i in held:
            b, r = before[i], after[i]
            if not self.active[b.model_id]:
                assert r.status == "superseded"
                continue
            if charged:
                status = "failed" if b.attempts >= b.max_attempts else "retry"
                assert (r.status, r.attempts, r.faults) == (status, b.attempts, b.faults)
            else:
                assert r.status == ("pending" if b.attempts <= 1 else "retry"), (r, b)
                assert r.attempts == max(b.attempts - 1, 0), "an unusable answer used an attempt of a batch"
                assert r.faults == b.faults + (1 if counted else 0)
            assert applied[i] == r.status and r.lease_owner is None
        assert self._vectors().keys() == vectors.keys(), "an unusable answer stored a vector"
        self._assert_unchanged(before, after, set(before) - set(held), "unusable_answer")
        if claim.probe:
            provider_state.release_probe(self.conn, claim.model_id, claim.owner)

    # ------------------------------------------------------------------ leases
    @precondition(lambda self: self._live_claims())
    @rule(pick=st.integers(0, 10**6), every=st.booleans())
    def expire_lease(self, pick, every):
        """The database clock passes a lease (or all of them): the worker died or stalled."""
        ids = [r.job_id for r in self._by_content(self.seen) if r.status == "processing"]
        target = ids if every else [ids[pick % len(ids)]]
        self.conn.execute(
            "UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second' WHERE job_id = ANY(%s)",
            (target,),
        )

    @precondition(lambda self: self._any(lambda r: r.status == "processing" and r.expired))
    @rule(backoff=st.booleans())
    def rescue(self, backoff):
        base = cap = 600.0 if backoff else 0.0
        with self.conn.transaction():
            before = self._rows()
            counts = transitions.rescue_expired(self.conn, base=base, cap=cap)
        after = self._rows()
        expired = [i for i, r in before.items() if r.status == "processing" and r.expired]

        # A crash is the claim's fault: the attempt given back and a fault counted, unless the
        # job was the only one rescued from its worker process (the owner up to its last '/')
        # after FREE_FAULTS faults (then charged).
        def process(owner: str) -> str:
            return owner[: owner.rindex("/") + 1] if "/" in owner else owner

        processes = [process(before[i].lease_owner) for i in expired]
        expected, attempts, faults = {}, {}, {}
        for i in expired:
            b = before[i]
            charged = processes.count(process(b.lease_owner)) == 1 and b.faults >= request_plan.FREE_FAULTS
            if not self.active[b.model_id]:
                expected[i], attempts[i], faults[i] = "superseded", b.attempts, b.faults
            elif charged:
                expected[i] = "failed" if b.attempts >= b.max_attempts else "retry"
                attempts[i], faults[i] = b.attempts, b.faults
            else:
                expected[i] = "retry" if b.attempts > 1 else "pending"
                attempts[i], faults[i] = max(b.attempts - 1, 0), b.faults + 1
        for i in expired:
            r = after[i]
            assert (r.status, r.lease_owner, r.leased, r.attempts, r.faults) == (
                expected[i],
                None,
                False,
                attempts[i],
                faults[i],
            ), f"rescue of job {i}: {r}"
            if not backoff:
                assert r.available
        counted = {i: "retry" if v == "pending" else v for i, v in expected.items()}
        want = {s: sum(1 for v in counted.values() if v == s) for s in ("retry", "failed", "superseded")}
        assert dict(counts) == want, f"rescue counted {counts}, expected {want}"
        self._assert_unchanged(before, after, set(before) - set(expired), "rescue")

    @precondition(
        lambda self: self.breaker_waits or self._any(lambda r: r.status in ("pending", "retry") and not r.available)
    )
    @rule()
    def tick(self):
        """The database clock moves two hours on: every delay, backoff and breaker pause is over
        (leases are left alone: expire_lease does those)."""
        c = self.conn
        c.execute("UPDATE app.embedding_jobs SET available_at = available_at - interval '2 hours'")
        c.execute(
            "UPDATE app.provider_state SET paused_until = paused_until - interval '2 hours',"
            " probe_until = probe_until - interval '2 hours'"
        )

    # ------------------------------------------------------------------ content
    @precondition(lambda self: self.members)
    @rule(pick=st.integers(0, 10**6))
    def drop_chunk(self, pick):
        """Ingest replaces a document's chunks without this one: in one transaction the
        chunk row goes and content nobody wants any more is superseded (vectors deleted)."""
        doc, label = sorted(self.members)[pick % len(self.members)]
        s = SUMS[label]
        before = self._rows()
        with self.conn.transaction():
            self.conn.execute(
                "DELETE FROM app.chunks WHERE doc_pk = %s AND chunk_index = %s", (self.doc_pks[doc], label)
            )
            self.members.discard((doc, label))
            n = transitions.supersede_unwanted(self.conn, [s])
        after = self._rows()
        still_wanted = s in self._wanted_sums()
        moved = [
            i
            for i, r in before.items()
            if r.chunk_checksum == s
            and not still_wanted
            and r.status in ("pending", "retry", "processing", "ready", "failed")
        ]
        assert n == len(moved), f"drop_chunk superseded {n}, expected {len(moved)}"
        for i in moved:
            assert (after[i].status, after[i].lease_owner, after[i].leased) == ("superseded", None, False)
            self.expected_vectors.pop((s, before[i].model_id), None)
        self._assert_unchanged(before, after, set(before) - set(moved), "drop_chunk")

    @precondition(lambda self: len(self.members) < DOCS * len(LABELS))
    @rule(pick=st.integers(0, 10**6))
    def restore_chunk(self, pick):
        """Ingest writes a document that (again) carries this content: chunk row,
        enqueue for the document, revive superseded jobs of the content."""
        absent = sorted(set(itertools.product(range(DOCS), range(len(LABELS)))) - self.members)
        doc, label = absent[pick % len(absent)]
        s = SUMS[label]
        before = self._rows()
        with self.conn.transaction():
            self._insert_chunk(doc, label)
            transitions.enqueue_for_docs(self.conn, [self.doc_pks[doc]], MAX_ATTEMPTS)
            transitions.revive_wanted(self.conn, [s])
        after = self._rows()
        new = set(after) - set(before)
        have = {(r.chunk_checksum, r.model_id) for r in before.values()}
        expected_new = {m for m in MODELS if self.active[m] and (s, m) not in have}
        assert {after[i].model_id for i in new} == expected_new and all(after[i].chunk_checksum == s for i in new), (
            f"restore_chunk enqueued {[(after[i].chunk_checksum.hex()[:8], after[i].model_id) for i in new]}"
        )
        for i in new:
            assert (after[i].status, after[i].attempts, after[i].max_attempts) == ("pending", 0, MAX_ATTEMPTS)
        revived = [
            i
            for i, r in before.items()
            if r.chunk_checksum == s and r.status == "superseded" and self.active[r.model_id]
        ]
        for i in revived:
            assert (after[i].status, after[i].attempts) == ("pending", 0)
        self._assert_unchanged(before, after, set(before) - set(revived), "restore_chunk")

    # ------------------------------------------------------------------ models
    @precondition(lambda self: all(self.active.values()))  # one model retired at a time: the other keeps working
    @rule(pick=st.integers(0, 10**6))
    def retire_model(self, pick):
        active = [m for m in MODELS if self.active[m]]
        model = active[pick % len(active)]
        before = self._rows()
        n = models.retire(self.conn, model)
        self.active[model] = False
        after = self._rows()
        moved = [i for i, r in before.items() if r.model_id == model and r.status in ("pending", "retry")]
        assert n == len(moved)
        for i in moved:
            assert after[i].status == "superseded"
        self._assert_unchanged(before, after, set(before) - set(moved), "retire")

    @precondition(lambda self: not all(self.active.values()))
    @rule(again=st.booleans())
    def activate_model(self, again):
        """`models activate` of the retired model (and, with ``again``, a second time: a no-op)."""
        model = next(m for m in MODELS if not self.active[m])
        if again:
            self._activate(model)
        self._activate(model)

    def _activate(self, model: str) -> None:
        before = self._rows()
        was_retired, revived, enqueued = model_admin.reactivate(self.conn, model, MAX_ATTEMPTS)
        assert was_retired == (not self.active[model])
        self.active[model] = True
        after = self._rows()
        if not was_retired:
            assert (revived, enqueued) == (0, 0) and after == before
            return
        wanted = self._wanted_sums()
        expect_revived = [
            i
            for i, r in before.items()
            if r.status == "superseded" and r.chunk_checksum in wanted and self.active[r.model_id]
        ]
        have = {(r.chunk_checksum, r.model_id) for r in before.values()}
        expect_new = {(s, model) for s in wanted if (s, model) not in have}
        assert revived == len(expect_revived), f"activate revived {revived}, expected {len(expect_revived)}"
        assert {(after[i].chunk_checksum, after[i].model_id) for i in set(after) - set(before)} == expect_new
        assert enqueued == len(expect_new)
        for i in expect_revived:
            assert (after[i].status, after[i].attempts) == ("pending", 0)
        self._assert_unchanged(before, after, set(before) - set(expect_revived), "activate")

    # ------------------------------------------------------------------ dead letter
    @precondition(lambda self: self._any(lambda r: r.status == "failed"))
    @rule(pick=st.integers(0, 10**6), every=st.booleans())
    def requeue(self, pick, every):
        before = self._rows()
        failed = [r.job_id for r in self._by_content(before) if r.status == "failed"]
        ids = failed if every else [failed[pick % len(failed)]]
        counts = transitions.requeue_failed(self.conn, [] if every else ids, all_failed=every)
        wanted = self._wanted_sums()
        after = self._rows()
        for i in ids:
            b = before[i]
            status = "pending" if b.chunk_checksum in wanted and self.active[b.model_id] else "superseded"
            assert (after[i].status, after[i].attempts) == (status, 0), f"requeue of job {i}: {after[i]}"
            assert after[i].available
        assert sum(counts.values()) == len(ids)
        self._assert_unchanged(before, after, set(before) - set(ids), "requeue")

    # ------------------------------------------------------------------ drain
    def _drain(self) -> None:
        c = self.conn
        self.tick()
        c.execute(
            "UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second' WHERE status = 'processing'"
        )
        self.rescue(backoff=False)
        for _ in range(50):
            progressed = False
            for model in MODELS:
                claim = self._claim(model, 100)
                if claim is not None:
                    progressed = True
                    self._complete(claim)
            if not progressed:
                break
        else:
            raise AssertionError("the drain did not finish in 50 rounds")
        wanted = self._wanted_sums()
        rows = self._rows()
        by_key = {(r.chunk_checksum, r.model_id): r for r in rows.values()}
        for s in wanted:
            for m in MODELS:
                if self.active[m]:
                    r = by_key.get((s, m))
                    assert r is not None and r.status in ("ready", "failed"), (
                        f"after the drain, wanted ({s.hex()[:8]}, {m}) is {r}"
                    )
        stuck = [r for r in rows.values() if self.active[r.model_id] and r.status in ("pending", "retry", "processing")]
        assert not stuck, f"after the drain, jobs of active models are still queued: {stuck}"

    @precondition(lambda self: self.drains < 2)
    @rule()
    def drain(self):
        self.drains += 1
        self._drain()

    def teardown(self) -> None:
        if sys.exc_info()[0] is None:  # not while an earlier failure is propagating
            self._drain()
            self.check()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def check(self):
        """After every rule: a vector exists exactly when its job is ``ready``, and it is the winning
        completion's (a stale owner's stores nothing); every ready job of an active model, and every
        pending, retry or processing job, has a current chunk carrying its checksum; ``processing``
        exactly when a lease (owner and expiry) is set; ``app.job_keys`` and ``app.embedding_jobs``
        are one-to-one; attempts within ``[0, max_attempts]`` unless ``failed``; every wanted
        (checksum, active model) has a job that is not ``superseded``."""
        c = self.conn
        self._observe()
        rows = self.seen
        vectors = self._vectors()
        ready = {(r.chunk_checksum, r.model_id) for r in rows.values() if r.status == "ready"}
        assert set(vectors) == ready, (
            f"vectors without a ready job: {[(s.hex()[:8], m) for s, m in set(vectors) - ready]}; "
            f"ready jobs without a vector: {[(s.hex()[:8], m) for s, m in ready - set(vectors)]}"
        )
        for key, v in vectors.items():
            assert key in self.expected_vectors and np.array_equal(v, self.expected_vectors[key]), (
                f"the vector of {key[0].hex()[:8]}/{key[1]} is not the winning completion's"
            )
        wanted = self._wanted_sums()
        for r in rows.values():
            if r.status == "ready" and self.active[r.model_id]:
                assert r.chunk_checksum in wanted, f"ready job {r.job_id} of an active model has no current chunk"
            if r.status in ("pending", "retry", "processing"):
                assert r.chunk_checksum in wanted, f"{r.status} job {r.job_id} has no current chunk"
            assert (r.status == "processing") == (r.lease_owner is not None) == r.leased, (
                f"job {r.job_id}: status {r.status} with lease {r.lease_owner!r}"
            )
            assert r.attempts >= 0 and (r.attempts <= r.max_attempts or r.status == "failed"), (
                f"job {r.job_id}: {r.attempts} attempts of {r.max_attempts} while {r.status}"
            )
        keys = c.execute("""
            SELECT (SELECT count(*) FROM app.job_keys),
                   (SELECT count(*) FROM app.embedding_jobs),
                   (SELECT count(*) FROM app.job_keys k JOIN app.embedding_jobs j
                      ON j.job_id = k.job_id AND j.chunk_checksum = k.chunk_checksum AND j.model_id = k.model_id),
                   (SELECT count(DISTINCT (chunk_checksum, model_id)) FROM app.embedding_jobs)""").fetchone()
        assert keys[0] == keys[1] == keys[2] == keys[3], f"job_keys/jobs not one-to-one: {keys}"
        by_key = {(r.chunk_checksum, r.model_id): r for r in rows.values()}
        for s in wanted:
            for m in MODELS:
                if self.active[m]:
                    r = by_key.get((s, m))
                    assert r is not None and r.status != "superseded", (
                        f"wanted content {s.hex()[:8]} of active model {m} has job {r}"
                    )
        assert dict(c.execute("SELECT model_id, active FROM app.models")) == self.active
        if self.check_retired_queue:
            waiting = [r for r in rows.values() if r.status in ("pending", "retry") and not self.active[r.model_id]]
            assert not waiting, f"jobs of a retired model wait for a worker: {waiting}"


if PROFILE == "pipeline-jobs-default":
    JobStateMachine = seed(20250108)(JobStateMachine)


@pytest.mark.timeout(1200)  # a failure is shrunk for up to five minutes before hypothesis prints it
def test_job_state_machine(conn):
    # Job ids are handed out in the order of the enqueue statement's plan, which follows
    # the tables' statistics, and a claim breaks ties of available_at by job id: an
    # autovacuum ANALYZE in the middle of the run would make the same choices lead to
    # other states (hypothesis reports that as flaky). This module's own database keeps
    # the statistics it started with.
    for table in ("documents", "chunks", "models", "job_keys", "embedding_jobs", "embeddings", "provider_state"):
        conn.execute(f"ALTER TABLE app.{table} SET (autovacuum_enabled = false)")
    JobStateMachine.conn = conn
    try:
        run_state_machine_as_test(JobStateMachine, settings=settings.get_profile(PROFILE))
    finally:
        JobStateMachine.conn = None


@pytest.mark.parametrize("how", ["give_back", "throttle", "fail_retryable"])
def test_retired_model_jobs_never_wait(clean_db, how):
    """A worker holds a job when its model is retired; its call then ends in a give-back
    (shutdown, a fault of ours), a throttle or a retryable error. Like a rescued one, the
    job must not wait in the queue of a model nobody may run; `models activate` brings it back."""
    conn = clean_db
    models.ensure_model(conn, SPECS[0])
    source = conn.execute("INSERT INTO app.sources (root) VALUES ('/prop') RETURNING source_id").fetchone()[0]
    doc = conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status)"
        " VALUES (%s, 'd', 'file:///d', 'current') RETURNING doc_pk",
        (source,),
    ).fetchone()[0]
    conn.execute(
        "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start,"
        " char_end) VALUES (%s, 0, %s, 'text', 3, 0, 4)",
        (doc, SUMS[0]),
    )
    transitions.enqueue_for_docs(conn, [doc], MAX_ATTEMPTS)
    [job] = transitions.claim(conn, model_id=MODELS[0], owner="w/1", limit=1, lease_seconds=LEASE)
    models.retire(conn, MODELS[0])
    if how == "fail_retryable":
        moved = job_helpers.fail_retryable(
            conn, owner="w/1", job_ids=[job.job_id], delays=[0.0], error_class="server_error", message="HTTP 500"
        )
        assert list(moved) == [job.job_id]
    else:
        assert job_helpers.give_back(conn, owner="w/1", job_ids=[job.job_id], throttled=how == "throttle") == [
            job.job_id
        ]
    status = conn.execute("SELECT status FROM app.embedding_jobs WHERE job_id = %s", (job.job_id,)).fetchone()[0]
    assert model_admin.reactivate(conn, MODELS[0], MAX_ATTEMPTS)[0]
    revived = conn.execute("SELECT status FROM app.embedding_jobs WHERE job_id = %s", (job.job_id,)).fetchone()[0]
    assert revived == "pending"
    assert status not in ("pending", "retry"), f"a job of the retired model waits for a worker ({status})"
