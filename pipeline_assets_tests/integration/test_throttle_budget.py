"""Shared throttling (the circuit breaker in app.provider_state) and token budgets."""

from __future__ import annotations

import json

from pipeline_assets_tests import job_helpers
from pipeline_assets_tests.data_helpers import job_counts, write_corpus
from pipeline_assets_tests.processes import cli


def calls(conn):
    return conn.execute("SELECT outcome, called_at FROM app.provider_calls ORDER BY call_id").fetchall()


def test_429_pauses_every_worker_and_keeps_attempts(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 12)
    cli("ingest", str(tmp_path / "c"), env=env)
    fake.fail_next(1, 429, retry_after="1.0")
    env = {**env, "PIPELINE_BATCH_INPUTS": "2"}
    out = json.loads(cli("work", "--until-idle", "--concurrency", "4", "--json", env=env).stdout)
    conn = clean_db
    assert job_counts(conn) == {"ready": 12}
    # Throttling is the provider's state: no item lost an attempt to it.
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs").fetchone()[0] == 1
    assert out["throttled"] == 2
    history = calls(conn)
    throttled_at = next(at for outcome, at in history if outcome == "rate_limited")
    # Calls that start after the 429 wait for the Retry-After, in every thread: the pause
    # is shared, not local to the thread that saw it. Only a thread already past the
    # breaker when the 429 was recorded may still start its call (one each, at most
    # concurrency - 1 of them, however late a busy machine schedules it); an unshared
    # pause lets the other threads send the rest of the 6 calls inside the window.
    # (called_at is when a call started; calls already in flight may finish.)
    started_during_pause = [at for outcome, at in history if 0 < (at - throttled_at).total_seconds() < 0.9]
    assert len(started_during_pause) <= 4 - 1, history
    assert any((at - throttled_at).total_seconds() >= 0.9 for outcome, at in history if outcome == "ok")
    state = conn.execute("SELECT tripped, consecutive_failures FROM app.provider_state").fetchone()
    assert state == (False, 0)  # the half-open probe succeeded and closed the breaker


def test_repeated_5xx_trips_the_breaker_then_half_open_probe_closes_it(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 10)
    cli("ingest", str(tmp_path / "c"), env=env)
    fake.fail_next(5, 503)  # BREAKER_THRESHOLD consecutive failures
    env = {**env, "PIPELINE_BATCH_INPUTS": "1", "PIPELINE_MAX_ATTEMPTS": "10"}
    cli("work", "--until-idle", "--concurrency", "3", env=env)
    conn = clean_db
    assert job_counts(conn) == {"ready": 10}
    outcomes = [o for o, _ in calls(conn)]
    # One of the 503s may answer the worker's trivial check (does the provider answer anyone?).
    assert outcomes.count("http_503") + outcomes.count("health_probe_http_503") == 5
    assert outcomes.count("ok") == 10
    # (When the worker's trivial check got an answer, the 503s were the requests' and the breaker
    # counted none of them: no row at all.)
    tripped, failures = conn.execute("SELECT tripped, consecutive_failures FROM app.provider_state").fetchone() or (
        False,
        0,
    )
    # The probe closed the breaker. A 503 of a call that started before the trip may be recorded
    # after the last success on a loaded machine (each thread records its own outcome): at most
    # one per other thread, never enough to trip it again.
    assert not tripped and failures <= 3 - 1


def test_half_open_admits_one_probe_at_a_time(conn, clean_db):
    from pipeline_assets.jobqueue import provider_state, transitions
    from pipeline_assets.providers import ModelSpec
    from pipeline_assets.registry import models

    spec = ModelSpec(
        provider="test", name="probe", dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
    )
    models.ensure_model(conn, spec)
    src = conn.execute("INSERT INTO app.sources (root) VALUES ('/probe') RETURNING source_id").fetchone()[0]
    doc = conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status)"
        " VALUES (%s, 'd', 'file:///d', 'current') RETURNING doc_pk",
        (src,),
    ).fetchone()[0]
    for i in range(4):
        conn.execute("INSERT INTO app.chunks VALUES (%s, %s, %s, 't', 1, 0, 1)", (doc, i, bytes([i + 1])))
    transitions.enqueue_for_docs(conn, [doc], 5)
    job_helpers.pause_provider(conn, spec.model_id, 60)
    assert transitions.claim(conn, model_id=spec.model_id, owner="a", limit=1, lease_seconds=30) == []
    # A call that was already in flight and succeeds cannot cut the pause short.
    provider_state.provider_healthy(conn, spec.model_id)
    assert conn.execute("SELECT tripped FROM app.provider_state").fetchone()[0] is True
    assert transitions.claim(conn, model_id=spec.model_id, owner="a", limit=1, lease_seconds=30) == []
    conn.execute("UPDATE app.provider_state SET paused_until = now() - interval '1 second'")
    probe = transitions.claim(conn, model_id=spec.model_id, owner="a", limit=1, lease_seconds=30)
    assert len(probe) == 1 and probe[0].probe
    # While the probe is out, nobody else claims.
    assert transitions.claim(conn, model_id=spec.model_id, owner="b", limit=1, lease_seconds=30) == []
    provider_state.provider_healthy(conn, spec.model_id)  # the probe succeeded: closed
    rest = transitions.claim(conn, model_id=spec.model_id, owner="b", limit=10, lease_seconds=30)
    assert len(rest) == 3 and not any(j.probe for j in rest)


def test_daily_token_budget_stops_claiming_and_leaves_jobs_pending(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 30)
    cli("ingest", str(tmp_path / "c"), env=env)
    env = {**env, "PIPELINE_BATCH_INPUTS": "2", "PIPELINE_DAILY_TOKEN_BUDGET": "200"}
    proc = cli("work", "--until-idle", "--concurrency", "1", env=env, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: daily token budget of 200 reached") and len(proc.stderr.splitlines()) == 1
    conn = clean_db
    counts = job_counts(conn)
    assert counts.get("pending", 0) > 0 and "processing" not in counts
    billed = conn.execute("SELECT sum(tokens) FROM app.provider_calls").fetchone()[0]
    assert 200 <= billed < 200 + 2 * 100  # overshoot bounded by the requests in flight
