"""Provider faults a real deployment meets first.

Real worker processes (the CLI) or an in-process ``Worker`` against the real
PostgreSQL and the fake OpenAI server; every assertion is on outcomes: job
rows, stored vectors, the breaker's row, billed inputs, wall time.
"""

from __future__ import annotations

import json
import time

import pytest

from pipeline_assets.providers import RETRYABLE, ProviderError
from pipeline_assets.providers.base import BAD_RESPONSE
from pipeline_assets.store import db
from pipeline_assets_tests import job_helpers
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.processes import cli

# The soak's corpus: 30 documents of two chunks each.
SOAK_DOCUMENTS = 30
SOAK_WORDS = 300  # ~600 tokens: two 512-token chunks per document
# The requirement: this corpus under these faults in under 60 s; the wall time is printed. What is
# asserted is a bound against a hang only (a loaded machine may take minutes): the faults that were
# the bugs stall for an hour or a day here (a probe holding its slot for a lease of an hour, an
# uncapped Retry-After of a day), far beyond it.
HANG_SECONDS = 300.0
LONG_LEASE = "3600"


def chunk_texts(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks ORDER BY 1")]


# -- a failed or empty half-open probe releases its slot; the pause follows Retry-After ---------


def test_corpus_completes_under_random_429_and_500(env, fake, clean_db, tmp_path):
    """30% of requests 429 (Retry-After: 1), 10% 500, default backoff settings:
    every chunk ready in under a minute, nothing billed twice."""
    write_corpus(tmp_path / "c", SOAK_DOCUMENTS, words=SOAK_WORDS)
    cli("ingest", str(tmp_path / "c"), env=env)
    conn = clean_db
    texts = chunk_texts(conn)
    assert len(texts) == 2 * SOAK_DOCUMENTS
    fake.random_faults = [[0.3, 429, "1"], [0.1, 500, None]]
    fake.fault_seed = 4  # its draws begin 429, 429, 500, 429, 429: both faults are met
    run_env = {**env, "PIPELINE_BATCH_INPUTS": "8", "PIPELINE_BACKOFF_BASE": "1", "PIPELINE_BACKOFF_CAP": "60"}
    started = time.monotonic()
    # An hour's lease: a failed or empty probe that kept its slot for a lease would stall for an hour.
    out = json.loads(
        cli("work", "--until-idle", "--json", "--lease-seconds", LONG_LEASE, env=run_env, timeout=HANG_SECONDS).stdout
    )
    wall = time.monotonic() - started
    stats = fake.stats
    print(
        f"\nsoak: wall={wall:.1f}s requests={stats['requests']} by_status={stats['responses_by_status']} "
        f"billed_inputs={stats['billed_inputs']} unique_inputs={len(texts)} report={out}"
    )
    assert job_counts(conn) == {"ready": len(texts)}
    assert wall < HANG_SECONDS
    # 429 and 500 are not billed by the fake; no answer was lost: nothing may be billed twice.
    assert stats["billed_inputs"] - fake.billed_count("ping") == len(texts)  # "ping": the worker's checks
    assert all(fake.billed_count(t) == 1 for t in texts)
    assert stats["responses_by_status"].get(429, 0) > 0 and stats["responses_by_status"].get(500, 0) > 0
    assert_vectors_match(conn, fake)


def _queue(conn, n: int, model: str = "probe"):
    """A model with n pending jobs (no provider): returns its model id."""
    from pipeline_assets.jobqueue import transitions
    from pipeline_assets.providers import ModelSpec
    from pipeline_assets.registry import models

    spec = ModelSpec(
        provider="test", name=model, dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
    )
    models.ensure_model(conn, spec)
    src = conn.execute("INSERT INTO app.sources (root) VALUES ('/probe') RETURNING source_id").fetchone()[0]
    doc = conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status)"
        " VALUES (%s, 'd', 'file:///d', 'current') RETURNING doc_pk",
        (src,),
    ).fetchone()[0]
    for i in range(n):
        conn.execute("INSERT INTO app.chunks VALUES (%s, %s, %s, 't', 1, 0, 1)", (doc, i, bytes([i + 1])))
    transitions.enqueue_for_docs(conn, [doc], 5)
    return spec.model_id


def _pause_over(conn) -> None:
    conn.execute("UPDATE app.provider_state SET paused_until = now() - interval '1 millisecond'")


def test_a_failed_probe_frees_the_slot_and_the_pause_follows_retry_after(conn, clean_db):
    from pipeline_assets.jobqueue import provider_state, transitions

    model = _queue(conn, 4)
    job_helpers.pause_provider(conn, model, 60)
    _pause_over(conn)
    probe = transitions.claim(conn, model_id=model, owner="a", limit=1, lease_seconds=30)
    assert [j.probe for j in probe] == [True]
    assert transitions.claim(conn, model_id=model, owner="b", limit=1, lease_seconds=30) == []  # one probe at a time
    # The probe is throttled with Retry-After: 1.5: the pause is 1.5 s, not the probe's 30 s lease.
    job_helpers.give_back(conn, owner="a", job_ids=[probe[0].job_id], delay=1.5, throttled=True)
    with conn.transaction():  # one now() for the pause and its reading: no slack for a slow machine
        provider_state.provider_failure(conn, model, trip=True, floor=1.5, base=1.0, cap=60.0, threshold=5)
        paused_for, probe_owner = conn.execute(
            "SELECT extract(epoch FROM paused_until - now()), probe_owner FROM app.provider_state"
        ).fetchone()
    assert 1.4 <= float(paused_for) <= 1.5 and probe_owner is None
    assert transitions.claim(conn, model_id=model, owner="b", limit=1, lease_seconds=30) == []  # still paused
    _pause_over(conn)
    again = transitions.claim(conn, model_id=model, owner="b", limit=1, lease_seconds=30)
    assert [j.probe for j in again] == [True]  # the next probe goes out as soon as the pause ends
    # A throttle is counted on the job (and costs no attempt).
    assert conn.execute(
        "SELECT throttles, attempts FROM app.embedding_jobs WHERE job_id = %s", (probe[0].job_id,)
    ).fetchone() == (1, 0)


def test_a_failed_5xx_probe_frees_the_slot_at_once(conn, clean_db):
    from pipeline_assets.jobqueue import provider_state, transitions

    model = _queue(conn, 4)
    job_helpers.pause_provider(conn, model, 60)
    _pause_over(conn)
    assert transitions.claim(conn, model_id=model, owner="a", limit=1, lease_seconds=30)[0].probe
    # One 5xx (below the breaker's threshold) on the probe: its job backs off on its
    # own; the next probe may go out at once instead of after the probe's lease.
    provider_state.provider_failure(conn, model, trip=False, floor=0.0, base=10.0, cap=10.0, threshold=5)
    assert conn.execute("SELECT tripped, probe_owner FROM app.provider_state").fetchone() == (True, None)
    assert transitions.claim(conn, model_id=model, owner="b", limit=1, lease_seconds=30)[0].probe
    # At the threshold, a failure pauses again (a full-jitter backoff without a Retry-After).
    for _ in range(4):
        provider_state.provider_failure(conn, model, trip=False, floor=0.0, base=10.0, cap=10.0, threshold=5)
    assert conn.execute("SELECT paused_until >= updated_at, probe_owner FROM app.provider_state").fetchone() == (
        True,
        None,
    )


def test_a_probe_claim_that_finds_nothing_holds_no_slot(conn, clean_db):
    from pipeline_assets.jobqueue import transitions
    from pipeline_assets.jobqueue.pg_job_store import PostgresJobStore

    model = _queue(conn, 2)
    conn.execute("UPDATE app.embedding_jobs SET available_at = now() + interval '1 hour'")
    job_helpers.pause_provider(conn, model, 60)
    _pause_over(conn)
    assert transitions.claim(conn, model_id=model, owner="a", limit=5, lease_seconds=30) == []
    assert conn.execute("SELECT probe_owner, probe_until > now() FROM app.provider_state").fetchone() == (None, False)
    conn.execute("UPDATE app.embedding_jobs SET available_at = now()")
    probe = transitions.claim(conn, model_id=model, owner="b", limit=1, lease_seconds=30)
    assert [j.probe for j in probe] == [True]
    # A probe claim that ends without closing the breaker (a 400, nothing sent) releases it.

    class Pool:  # PostgresJobStore over this one connection
        def connection(self):
            import contextlib

            return contextlib.nullcontext(conn)

    PostgresJobStore(Pool(), model_id=model, worker_id="w", backoff_base=1, backoff_cap=1).release_probe("b")
    assert transitions.claim(conn, model_id=model, owner="c", limit=1, lease_seconds=30)[0].probe


# -- Retry-After is capped, and status says so --------------------------------------------------


def test_a_day_long_retry_after_is_capped_and_status_shows_the_breaker(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 6)
    cli("ingest", str(tmp_path / "c"), env=env)
    conn = clean_db
    fake.fail_next(1, 429, retry_after="86400")  # a proxy's Retry-After
    run_env = {**env, "PIPELINE_RETRY_AFTER_CAP": "1"}
    started = time.monotonic()
    cli("work", "--until-idle", env=run_env, timeout=HANG_SECONDS)
    assert time.monotonic() - started < HANG_SECONDS  # capped at 1 s, not the day asked for
    assert job_counts(conn) == {"ready": len(chunk_texts(conn))}
    assert fake.stats["responses_by_status"][429] == 1
    data = json.loads(cli("status", "--json", env=run_env).stdout)
    assert data["retry_after_cap"] == 1.0
    assert data["breaker"]["openai/fake-embed"]["state"] == "closed"
    # While the breaker is open, status says for how long.
    job_helpers.pause_provider(conn, "openai/fake-embed", 120)
    lines = cli("status", env=run_env).stdout.splitlines()
    breaker = next(line for line in lines if line.startswith("breaker openai/fake-embed:"))
    assert breaker.split(":", 1)[1].split()[0] == "open"
    assert 60 < float(breaker.split("paused_for=")[1].split("s")[0]) <= 120  # a slow machine: seconds pass
    assert "retry-after cap: 1s (PIPELINE_RETRY_AFTER_CAP)" in lines


# -- an always-throttled input is dead-lettered; the rest of the corpus moves ---------------------


def test_an_always_throttled_input_is_dead_lettered_and_the_rest_completes(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 12)
    (tmp_path / "c" / "huge.md").write_text("# huge\n\nALWAYS429 more than the account's tokens per minute\n")
    cli("ingest", str(tmp_path / "c"), env=env)
    conn = clean_db
    fake.throttle_marker = "ALWAYS429"  # 429 with Retry-After: 1 on every request holding it
    run_env = {**env, "PIPELINE_MAX_THROTTLES": "3", "PIPELINE_RETRY_AFTER_CAP": "0.2"}
    started = time.monotonic()
    cli("work", "--until-idle", "--concurrency", "2", env=run_env, timeout=HANG_SECONDS)
    wall = time.monotonic() - started
    texts = chunk_texts(conn)
    assert job_counts(conn) == {"ready": len(texts) - 1, "failed": 1}
    failed = conn.execute("""SELECT j.error_class, j.throttles, j.attempts, c.text FROM app.embedding_jobs j
                             JOIN app.chunks c USING (chunk_checksum) WHERE j.status = 'failed'""").fetchone()
    assert failed[0] == "throttled_too_often" and "ALWAYS429" in failed[3]
    assert failed[1] >= 3  # its requests shrank until it was alone; one more throttle dead-lettered it
    # Throttles cost the innocent inputs no attempt, and nothing was billed twice.
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0] == 1
    assert fake.stats["billed_inputs"] == len(texts) - 1
    print(
        f"\nthrottled input: wall={wall:.1f}s requests={fake.stats['requests']}"
        f" by_status={fake.stats['responses_by_status']}"
    )
    assert wall < HANG_SECONDS  # a hang bound: the bug was a model stalled forever


# -- other faults ------------------------------------------------------------------


def test_one_5xx_on_a_batch_does_not_isolate_its_inputs_nor_cost_them_an_attempt(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 23)
    cli("ingest", str(tmp_path / "c"), env=env)
    conn = clean_db
    fake.fail_next(1, 500)
    # Backoff 0: every retried job is claimable again at once, in one claim.
    cli("work", "--until-idle", "--concurrency", "1", env={**env, "PIPELINE_BACKOFF_BASE": "0"})
    texts = chunk_texts(conn)
    assert len(texts) == 23 and job_counts(conn) == {"ready": 23}
    # Before: the 23 retried inputs went out as 23 single-input requests. Now: the batch again, after
    # one trivial check ("ping": does the provider answer anyone?) that it answered.
    assert fake.stats["requests"] == 3 and fake.stats["responses_by_status"] == {500: 1, 200: 2}
    assert fake.billed_count("ping") == 1
    # The 500 is the provider's and the request's: no input paid an attempt for it; each
    # counts the fault (which would shrink its next requests to a quarter: 23 still fit in one).
    assert conn.execute(
        "SELECT min(attempts), max(attempts), min(faults), max(faults) FROM app.embedding_jobs"
    ).fetchone() == (1, 1, 1, 1)
    assert fake.stats["billed_inputs"] == 23 + 1


def test_only_a_split_for_a_bad_input_isolates(conn, clean_db):
    from pipeline_assets.jobqueue import request_plan, transitions
    from pipeline_assets.jobqueue.changes import Isolate

    model = _queue(conn, 5)
    held = transitions.claim(conn, model_id=model, owner="a", limit=5, lease_seconds=30)
    ids = [j.job_id for j in held]
    assert transitions.apply(conn, "b", [Isolate(tuple(ids))]) == [(Isolate(tuple(ids)), {})]  # not the holder
    transitions.apply(conn, "a", [Isolate(tuple(ids[:2]))])  # a split of a batch refused for a bad input
    job_helpers.give_back(conn, owner="a", job_ids=ids[:3])  # e.g. a throttle cut the split short
    job_helpers.fail_retryable(
        conn, owner="a", job_ids=ids[3:], delays=[0.0, 0.0], error_class="http_500", message="boom"
    )
    again = transitions.claim(conn, model_id=model, owner="c", limit=5, lease_seconds=30)
    assert {j.job_id: j.isolate for j in again} == {i: i in ids[:2] for i in ids}
    requests = request_plan.plan_requests(again, max_inputs=10, max_tokens=1000)
    assert sorted(map(len, requests)) == [1, 1, 3]  # the 5xx'd ones still travel together


def test_a_database_fault_after_the_call_uses_no_attempt_and_stops_the_worker(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 12)
    cli("ingest", str(tmp_path / "c"), env=env)
    conn = clean_db
    # A fault of our own after the provider answered: storing a vector is refused.
    conn.execute("""CREATE FUNCTION app.t_refuse() RETURNS trigger LANGUAGE plpgsql AS
                    $$ BEGIN RAISE EXCEPTION 'permission denied for table embeddings'
                       USING ERRCODE = 'insufficient_privilege'; END $$""")
    conn.execute("CREATE TRIGGER t_refuse BEFORE INSERT ON app.embeddings FOR EACH ROW EXECUTE FUNCTION app.t_refuse()")
    run_env = {**env, "PIPELINE_BATCH_INPUTS": "2"}
    try:
        proc = cli("work", "--until-idle", "--concurrency", "1", env=run_env, check=False, timeout=60)
    finally:
        conn.execute("DROP TRIGGER t_refuse ON app.embeddings")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]  # each fault before it is a one-line warning
    assert last.startswith("error: worker stopped after 3 faults of its own in a row")
    assert "InsufficientPrivilege: permission denied for table embeddings" in last
    assert "Traceback" not in proc.stderr
    # Nothing dead-lettered, no attempt used: the jobs were given back.
    counts = job_counts(conn)
    assert "failed" not in counts and "processing" not in counts and "ready" not in counts
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs").fetchone()[0] == 0
    assert fake.stats["requests"] == 3  # it stopped after three calls it could not store
    # Fixed: the next worker finishes, each input on its first attempt.
    cli("work", "--until-idle", env=run_env)
    assert job_counts(conn) == {"ready": len(chunk_texts(conn))}
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs").fetchone()[0] == 1
    assert_vectors_match(conn, fake)


def test_a_nan_vector_is_the_providers_fault_not_the_batch(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 6)
    (tmp_path / "c" / "nan.md").write_text("# nan\n\nNANVECTOR the provider answers this one with NaN\n")
    env = {**env, "PIPELINE_MAX_ATTEMPTS": "2"}  # set at enqueue
    cli("ingest", str(tmp_path / "c"), env=env)
    conn = clean_db
    fake.nan_marker = "NANVECTOR"
    cli("work", "--until-idle", "--concurrency", "1", env=env)
    texts = chunk_texts(conn)
    # The answer's good vectors are stored on the first call; only the NaN one is
    # retried, as a provider fault, and dead-lettered when its attempts are used up.
    assert job_counts(conn) == {"ready": len(texts) - 1, "failed": 1}
    failed = conn.execute("SELECT error_class, attempts FROM app.embedding_jobs WHERE status = 'failed'").fetchone()
    assert failed == ("bad_vector", 2)
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0] == 1
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == len(texts) - 1


def test_an_unreachable_database_is_waited_for_a_refusing_one_is_counted():
    import psycopg
    from psycopg_pool import PoolTimeout

    from pipeline_assets.jobqueue.faults import FaultCounter

    faults = FaultCounter()
    assert faults.count(psycopg.OperationalError("server closed the connection unexpectedly")) == (1, True)
    assert faults.count(PoolTimeout("no connection")) == (1, True)
    assert faults.count(psycopg.errors.AdminShutdown("terminating connection")) == (1, True)
    # A failover: the standby being promoted refuses connections, then writes, for a while.
    assert faults.count(psycopg.errors.CannotConnectNow("the database system is starting up")) == (1, True)
    assert faults.count(psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction")) == (
        1,
        True,
    )
    assert faults.count(db.DatabaseUnavailable("cannot connect to database")) == (1, True)
    assert faults.count(psycopg.errors.InsufficientPrivilege("permission denied")) == (1, False)
    assert faults.count(psycopg.errors.QueryCanceled("statement timeout")) == (2, False)
    assert faults.count(psycopg.errors.DeadlockDetected("deadlock detected")) == (3, False)
    faults.reset()  # a completion
    assert faults.count(RuntimeError("a bug")) == (1, False)


@pytest.mark.parametrize("texts", [["a", "b", "c"], ["alone"]], ids=["duplicate-index", "index-out-of-range"])
def test_an_answer_with_the_right_count_but_a_wrong_index_is_unmatched(fake, texts):
    """Each input's vector is the one carrying its index: a duplicate or missing index is an
    unusable answer of the provider (as a wrong count is), never vectors stored by position."""
    provider = fake.provider()
    try:
        assert len(provider.embed(texts).vectors) == len(texts)  # a sound answer passes
        fake.bad_index_rate = 1.0
        with pytest.raises(ProviderError) as caught:
            provider.embed(texts)
    finally:
        provider.close()
    assert fake.stats["bad_index"] == 1
    err = caught.value
    assert (err.kind, err.error_class) == (RETRYABLE, BAD_RESPONSE)
    assert f"expected {len(texts)} vectors indexed 0..{len(texts) - 1}, got indexes " in err.message
