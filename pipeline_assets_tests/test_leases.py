"""Leases under slow calls: a heartbeat keeps a healthy slow call's lease; the
per-call wall-clock timeout turns a stalled call into an ordinary failure."""

from __future__ import annotations

import json

from pipeline_assets_tests.conftest import cli, job_counts, start_cli, wait_until


def test_heartbeat_keeps_a_slow_healthy_call_from_being_stolen(env, fake, clean_db, tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "slow.md").write_text("SLOWDOC a slow but healthy provider call")
    cli("ingest", str(corpus), env=env)
    fake.slow_marker, fake.slow_seconds = "SLOWDOC", 4.0
    # The call takes 4 s; the lease is 1 s; heartbeats every lease/3 extend it.
    holder = start_cli("work", "--until-idle", "--json", "--lease-seconds", "1", "--worker-id", "holder", env=env)
    wait_until(lambda: fake.stats["requests"] >= 1, what="the slow call to start")
    other = json.loads(cli("work", "--until-idle", "--json", "--worker-id", "other", env=env).stdout)
    out, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    mine = json.loads(out)
    conn = clean_db
    assert mine["embedded"] == 1 and other["embedded"] == 0 and other["rescued"] == 0
    assert conn.execute("SELECT status, attempts FROM app.embedding_jobs").fetchone() == ("ready", 1)
    assert fake.billed_count("SLOWDOC a slow but healthy provider call") == 1  # never sent twice


def test_per_call_timeout_turns_a_stall_into_a_retryable_failure(env, fake, clean_db, tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "stall.md").write_text("STALL this call never answers in time")
    (corpus / "fine.md").write_text("an ordinary document")
    fake.slow_marker, fake.slow_seconds = "STALL", 30.0
    # One input per request: a timeout is not the input's fault, so nothing isolates the
    # stalling input from a neighbour in its request; here it has none.
    env = {**env, "PIPELINE_CALL_TIMEOUT": "0.5", "PIPELINE_MAX_ATTEMPTS": "2", "PIPELINE_BATCH_INPUTS": "1"}
    cli("embed", str(corpus), env=env, timeout=60)
    conn = clean_db
    assert job_counts(conn) == {"ready": 1, "failed": 1}
    assert conn.execute("SELECT error_class, attempts FROM app.embedding_jobs WHERE status = 'failed'"
                        ).fetchone() == ("timeout", 2)
