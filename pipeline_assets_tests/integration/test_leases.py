"""Leases under slow calls: a heartbeat keeps a healthy slow call's lease; the
per-call wall-clock timeout turns a stalled call into an ordinary failure."""

from __future__ import annotations

import json

from pipeline_assets_tests.data_helpers import job_counts
from pipeline_assets_tests.processes import cli, start_cli, wait_until


def test_heartbeat_keeps_a_slow_healthy_call_from_being_stolen(env, fake, clean_db, tmp_path):
    """A call held by the fake for longer than the lease it was claimed with: the heartbeat
    (every lease/3) extends the lease, so another worker, rescuing every second while the call
    is in flight, finds nothing to take.

    No duration decides the outcome: the fake holds the call until the database clock is past
    the claim's own lease and the other worker has been at it for a few seconds; only then is it
    answered. The lease (6 s, a beat every 2 s) leaves a beat 4 s of slack on a loaded machine,
    the call timeout is far above the hold, and a worker counts as dead only after a silent
    minute, so what keeps the job is the lease heartbeat alone."""
    text = "SLOWDOC a slow but healthy provider call"
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "slow.md").write_text(text)
    cli("ingest", str(corpus), env=env)
    conn = clean_db
    run_env = {**env, "PIPELINE_CALL_TIMEOUT": "600", "PIPELINE_WORKER_DEAD_AFTER": "60"}
    fake.hold("SLOWDOC")
    holder = start_cli("work", "--until-idle", "--json", "--lease-seconds", "6", "--worker-id", "holder", env=run_env)
    other = None
    try:
        wait_until(lambda: fake.held == 1, what="the slow call to reach the fake")
        (claimed_until,) = conn.execute("SELECT lease_expires_at FROM app.embedding_jobs").fetchone()
        # Past the lease the job was claimed with (a beat may already have moved it: later still).
        wait_until(
            lambda: conn.execute("SELECT now() > %s", (claimed_until,)).fetchone()[0],
            what="the claim's own lease to pass",
        )
        row = conn.execute(
            "SELECT status, lease_owner LIKE '%%holder%%', lease_expires_at > now(), attempts FROM app.embedding_jobs"
        ).fetchone()
        assert row == ("processing", True, True, 1), f"the lease was not extended: {row}"
        # The other worker rescues expired leases every second and stays until the job is done.
        other = start_cli("work", "--until-idle", "--json", "--worker-id", "other", env=run_env)
        wait_until(
            lambda: (
                conn.execute(
                    "SELECT now() > started_at + interval '3 seconds' FROM app.workers WHERE worker_id = 'other'"
                ).fetchone()
                == (True,)
            ),
            what="the other worker to have run for a few seconds",
        )
    finally:
        fake.release()
    out, err = holder.communicate(timeout=120)
    assert holder.returncode == 0, err
    other_out, other_err = other.communicate(timeout=120)
    assert other.returncode == 0, other_err
    mine, theirs = json.loads(out), json.loads(other_out)
    assert mine["embedded"] == 1 and theirs["embedded"] == 0 and theirs["rescued"] == 0
    assert conn.execute("SELECT status, attempts FROM app.embedding_jobs").fetchone() == ("ready", 1)
    assert fake.billed_count(text) == 1  # never sent twice


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
    assert conn.execute("SELECT error_class, attempts FROM app.embedding_jobs WHERE status = 'failed'").fetchone() == (
        "timeout",
        2,
    )
