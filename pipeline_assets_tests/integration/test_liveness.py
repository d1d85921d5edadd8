"""Crash recovery without waiting out the lease, lease owners
that are UUIDs, and a rescued job's backoff.

Every worker keeps a row in app.workers fresh (five beats per
PIPELINE_WORKER_DEAD_AFTER); a worker that stops beating is dead and its claims
are rescued by a live worker within seconds, however long their lease, while a
live worker's slow call keeps its lease.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from pipeline_assets.jobqueue import leases, transitions
from pipeline_assets.store import db
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.processes import cli, kill_group, start_cli, wait_until

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def test_killed_worker_claims_are_rescued_in_seconds_not_a_lease(env, fake, clean_db, tmp_path):
    corpus = tmp_path / "c"
    write_corpus(corpus, 60)
    env = {**env, "PIPELINE_BATCH_INPUTS": "20"}
    cli("ingest", str(corpus), env=env)
    conn = clean_db
    texts = [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks")]
    fake.latency = 3.0  # the victim's call is in flight when it dies; the provider still bills it
    # An hour's lease (the default is a minute): finishing before it ends proves the claims were rescued
    # for the worker's death, on a machine however loaded.
    victim = start_cli("work", "--concurrency", "1", "--worker-id", "victim", "--lease-seconds", "3600", env=env)
    wait_until(lambda: fake.stats["requests"] >= 1, what="the victim's call")
    kill_group(victim)
    killed_at = time.monotonic()
    fake.latency = 0.0
    held = conn.execute("""SELECT lease_owner, extract(epoch FROM lease_expires_at - now())
                           FROM app.embedding_jobs WHERE status = 'processing'""").fetchall()
    leases_end = conn.execute(
        "SELECT min(lease_expires_at) FROM app.embedding_jobs WHERE status = 'processing'"
    ).fetchone()[0]
    in_flight = len(held)
    assert in_flight == 20  # one full claim, sent as one request
    assert all(lease > 3000 for _, lease in held)  # its lease alone would hold them for an hour
    # Lease owners are the worker's UUID prefix and a claim sequence; the prefix is its liveness row.
    assert all(re.fullmatch(rf"victim/{UUID}/\d+", owner) for owner, _ in held)
    prefix = held[0][0].rsplit("/", 1)[0] + "/"
    assert conn.execute("SELECT worker_id FROM app.workers WHERE owner_prefix = %s", (prefix,)).fetchone() == (
        "victim",
    )

    restarted = json.loads(cli("work", "--until-idle", "--json", "--worker-id", "restarted", env=env).stdout)
    recovery = time.monotonic() - killed_at
    wait_until(lambda: fake.stats["billed_inputs"] >= len(texts) + in_flight, what="the dead call's bill")
    duplicates = sum(1 for t in texts if fake.billed_count(t) == 2)
    print(
        f"\nrecovery after SIGKILL with {in_flight} inputs in flight: the restarted worker finished the "
        f"corpus {recovery:.1f} s after the kill; {duplicates} inputs billed twice"
    )
    # Not the lease: the corpus was finished (on the database's clock) before the dead worker's
    # leases would have expired, so they were rescued for its death, not for their expiry.
    assert conn.execute("SELECT now() < %s", (leases_end,)).fetchone()[0], recovery
    assert restarted["rescued"] == in_flight
    assert job_counts(conn) == {"ready": len(texts)}
    # Duplicates bounded by what was in flight: exactly the dead claim's inputs, once more each.
    assert max(fake.billed_count(t) for t in texts) == 2
    assert duplicates == in_flight
    # The ledger had counted the dead call before it went out: it agrees with the bill.
    extra = conn.execute("SELECT coalesce(sum(sends - 1) FILTER (WHERE sends > 1), 0) FROM app.input_sends")
    assert extra.fetchone()[0] == in_flight
    assert_vectors_match(conn, fake)
    # The clean exit left; the dead worker's row stays until it is long dead.
    rows = [r[0] for r in conn.execute("SELECT worker_id FROM app.workers")]
    assert "victim" in rows and "restarted" not in rows


def test_a_live_workers_slow_call_keeps_its_lease(env, fake, clean_db, tmp_path):
    """A call longer than the liveness window, while another worker rescues every second."""
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "slow.md").write_text("SLOWDOC a slow call from a live worker")
    env = {**env, "PIPELINE_WORKER_DEAD_AFTER": "1"}
    cli("ingest", str(corpus), env=env)
    fake.slow_marker, fake.slow_seconds = "SLOWDOC", 4.0
    holder = start_cli("work", "--until-idle", "--json", "--lease-seconds", "2", "--worker-id", "holder", env=env)
    wait_until(lambda: fake.stats["requests"] >= 1, what="the slow call to start")
    other = json.loads(cli("work", "--until-idle", "--json", "--worker-id", "other", env=env).stdout)
    out, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    conn = clean_db
    assert json.loads(out)["embedded"] == 1 and other["rescued"] == 0 and other["embedded"] == 0
    assert conn.execute("SELECT status, attempts FROM app.embedding_jobs").fetchone() == ("ready", 1)
    assert fake.billed_count("SLOWDOC a slow call from a live worker") == 1


# -- the rescue rule, row by row ---------------------------------------------------------------------

MODEL = "test/liveness@2"


@pytest.fixture
def q(conn):
    conn.execute("""TRUNCATE app.sources, app.documents, app.chunks, app.embedding_jobs, app.job_keys,
                    app.embeddings, app.provider_state, app.models, app.workers CASCADE""")
    conn.execute("INSERT INTO app.models (model_id, provider, name, dimension) VALUES (%s, 'test', 'l', 2)", (MODEL,))
    conn.execute("INSERT INTO app.sources (root) VALUES ('/liveness')")
    doc = conn.execute("""INSERT INTO app.documents (source_id, document_id, source_uri, status)
                          SELECT source_id, 'd', 'd', 'current' FROM app.sources RETURNING doc_pk""").fetchone()[0]
    for i in range(3):
        conn.execute(
            """INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count,
                                                char_start, char_end)
                        VALUES (%s, %s, sha256(%s::bytea), %s, 1, 0, 1)""",
            (doc, i, f"t{i}".encode(), f"t{i}"),
        )
    transitions.enqueue_missing(conn, max_attempts=5)
    return conn


def worker_row(conn, prefix: str, *, alive_for: float, silent_for: float, dead_after: float = 5.0) -> None:
    """A worker row: beating since `alive_for` s ago, last beat `silent_for` s ago."""
    conn.execute(
        """INSERT INTO app.workers (owner_prefix, worker_id, model_id, host, pid, alive_since, beat_at,
                                             alive_until)
                    VALUES (%(p)s, %(p)s, %(m)s, 'h', 1, now() - make_interval(secs => %(alive)s),
                            now() - make_interval(secs => %(silent)s),
                            now() - make_interval(secs => %(silent)s) + make_interval(secs => %(d)s))""",
        {"p": prefix, "m": MODEL, "alive": alive_for, "silent": silent_for, "d": dead_after},
    )


def claim(conn, owner: str, limit: int = 1) -> list[int]:
    return [j.job_id for j in transitions.claim(conn, model_id=MODEL, owner=owner, limit=limit, lease_seconds=60)]


def status_of(conn, job_id: int) -> tuple:
    return conn.execute(
        "SELECT status, error_class, lease_owner FROM app.embedding_jobs WHERE job_id = %s", (job_id,)
    ).fetchone()


@pytest.mark.parametrize(
    "rescuer, alive_for, rescues",
    [
        ("veteran/", 60, True),  # beating long before the victim's deadline (3 s ago)
        ("early/", 4, True),  # started 4 s ago: beating when the deadline passed
        ("fresh/", 1, False),  # started 1 s ago (or back after a gap): it cannot tell yet
        (None, 0, False),  # no live rescuer (reconcile): leases only
    ],
)
def test_dead_owner_is_rescued_by_a_rescuer_that_was_beating_meanwhile(q, rescuer, alive_for, rescues):
    worker_row(q, "dead/", alive_for=60, silent_for=8)  # dead after 5 s: its deadline was 3 s ago
    worker_row(q, "alive/", alive_for=60, silent_for=0.5)  # beating
    if rescuer:
        worker_row(q, rescuer, alive_for=alive_for, silent_for=0.2)
    [dead_job] = claim(q, "dead/1")
    [alive_job] = claim(q, "alive/1")
    assert transitions.rescue_expired(q, rescuer=rescuer) == {"retry": int(rescues), "failed": 0, "superseded": 0}
    # Rescued: its attempt given back (a crash is the claim's fault), so pending again.
    assert status_of(q, dead_job) == (("pending", "worker_dead", None) if rescues else ("processing", None, "dead/1"))
    assert status_of(q, alive_job) == ("processing", None, "alive/1")  # a live owner keeps its 60 s lease


def test_an_outage_that_silenced_everyone_condemns_nobody(q):
    """After the database was unreachable for longer than the window, every row is
    stale; a worker's first beat after the gap restarts its alive_since."""
    worker_row(q, "a/", alive_for=60, silent_for=20)
    worker_row(q, "b/", alive_for=60, silent_for=20)
    [job] = claim(q, "b/1")
    q.execute(
        leases.WORKERS.beat, {"prefix": "a/", "worker": "a", "model": MODEL, "host": "h", "pid": 1, "dead_after": 5.0}
    )
    assert transitions.rescue_expired(q, rescuer="a/") == {"retry": 0, "failed": 0, "superseded": 0}
    assert status_of(q, job)[0] == "processing"
    # b never comes back: once a has beaten for a whole window, b is dead.
    q.execute("UPDATE app.workers SET alive_since = now() - interval '6 seconds' WHERE owner_prefix = 'a/'")
    assert transitions.rescue_expired(q, rescuer="a/") == {"retry": 1, "failed": 0, "superseded": 0}


def test_a_rescued_job_waits_out_the_backoff_of_its_faults(q):
    ids = claim(q, "gone/1", limit=3)
    q.execute("UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second'")
    assert transitions.rescue_expired(q, base=100.0, cap=30.0) == {"retry": 3, "failed": 0, "superseded": 0}
    waits = [
        r[0]
        for r in q.execute(
            """SELECT extract(epoch FROM available_at - now()) FROM app.embedding_jobs
                                        WHERE job_id = ANY(%s)""",
            (ids,),
        )
    ]
    assert all(0 <= w <= 30.0 for w in waits), waits  # uniform(0, min(cap, base * 2^faults))
    assert len(set(waits)) == 3  # full jitter: not one herd
    assert claim(q, "next/1", limit=3) == []  # not available at once


def test_the_liveness_row_is_kept_fresh_and_left_on_a_clean_stop(database_url, q):
    live = leases.Liveness(
        lambda: db.connect(database_url), owner_prefix="me/", worker_id="me", model_id=MODEL, dead_after=0.5
    ).start()
    try:
        first = q.execute(
            "SELECT beat_at, alive_until - beat_at FROM app.workers WHERE owner_prefix = 'me/'"
        ).fetchone()
        assert first[1].total_seconds() == pytest.approx(0.5)
        wait_until(
            lambda: q.execute(
                "SELECT beat_at > %s FROM app.workers WHERE owner_prefix = 'me/'", (first[0],)
            ).fetchone()[0],
            timeout=60,
            what="a second beat",
        )
    finally:
        live.stop()
    assert q.execute("SELECT count(*) FROM app.workers WHERE owner_prefix = 'me/'").fetchone()[0] == 0
