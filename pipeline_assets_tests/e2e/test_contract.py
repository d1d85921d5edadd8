"""The verification contract of the job state machine (seed 000), one test each.

Crashes are real worker processes frozen at a named point and killed with
SIGKILL; the provider is the fake OpenAI server over real HTTP; every
assertion is on outcomes: job rows, stored vectors, billed inputs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from pipeline_assets.jobqueue.evidence import MAX_EVIDENCE_FAULTS
from pipeline_assets.jobqueue.request_plan import FREE_FAULTS
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.processes import cli, kill_group, start_cli, wait_for_line, wait_until

JOBS_SNAPSHOT = "SELECT job_id, chunk_checksum, status, attempts FROM app.embedding_jobs ORDER BY 1"


def chunk_texts(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks ORDER BY 1")]


def assert_ledger_matches_bill(conn, fake, env) -> int:
    """The spend ledger's duplicate sends are exactly the provider's duplicate
    bills (sends recorded before each request, so a crash loses none), in the
    table and in `status`. Returns the number of duplicate bills."""
    billed = fake.stats["billed_by_text"]
    extra_billed = sum(n - 1 for n in billed.values() if n > 1)
    inputs_billed_twice = sum(1 for n in billed.values() if n > 1)
    ledger = conn.execute("""SELECT coalesce(sum(sends - 1) FILTER (WHERE sends > 1), 0),
                                    count(*) FILTER (WHERE sends > 1) FROM app.input_sends""").fetchone()
    assert ledger == (extra_billed, inputs_billed_twice)
    spend = json.loads(cli("status", "--json", env=env).stdout)["spend"]
    assert sum(s.get("extra_sends", 0) for s in spend.values()) == extra_billed
    assert sum(s.get("duplicate_inputs", 0) for s in spend.values()) == inputs_billed_twice
    return extra_billed


@pytest.fixture
def corpus(tmp_path):
    return tmp_path / "corpus"


# 1 -------------------------------------------------------------------------
def test_two_workers_claim_each_job_once(env, fake, clean_db, corpus):
    write_corpus(corpus, 120)
    cli("ingest", str(corpus), env=env)
    fake.latency = 0.02
    env = {**env, "PIPELINE_BATCH_INPUTS": "4"}
    workers = [
        start_cli("work", "--until-idle", "--concurrency", "2", "--worker-id", f"w{i}", env=env) for i in range(2)
    ]
    for w in workers:
        assert w.wait(timeout=120) == 0, w.stderr.read()
    conn = clean_db
    assert job_counts(conn) == {"ready": len(chunk_texts(conn))}
    # Each job was claimed exactly once (one attempt) and billed exactly once.
    assert conn.execute("SELECT max(attempts), min(attempts) FROM app.embedding_jobs").fetchone() == (1, 1)
    assert all(fake.billed_count(t) == 1 for t in chunk_texts(conn))
    assert fake.stats["billed_inputs"] == len(chunk_texts(conn))
    # Both workers really took part.
    workers_seen = {r[0] for r in conn.execute("SELECT DISTINCT worker_id FROM app.provider_calls")}
    assert workers_seen == {"w0", "w1"}
    assert_vectors_match(conn, fake)
    assert assert_ledger_matches_bill(conn, fake, env) == 0


def crashing_worker(env: dict, point: str):
    """A `work` process (one thread, 1 s leases) that stops dead at the crash point ``point``."""
    args = ("work", "--until-idle", "--lease-seconds", "1", "--concurrency", "1")
    return start_cli(*args, env={**env, "PIPELINE_CRASHPOINT": point})


# 2 -------------------------------------------------------------------------
def test_crash_before_provider_call(env, fake, clean_db, corpus):
    write_corpus(corpus, 10)
    cli("ingest", str(corpus), env=env)
    crashing = crashing_worker(env, "after_claim")
    wait_for_line(crashing, "CRASHPOINT after_claim")
    kill_group(crashing)
    conn = clean_db
    held = conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'processing'").fetchone()[0]
    assert held > 0
    assert fake.stats["requests"] == 0  # nothing was sent, nothing billed
    # A new worker waits for the dead worker's lease to expire, rescues and finishes.
    cli("work", "--until-idle", env=env)
    texts = chunk_texts(conn)
    assert job_counts(conn) == {"ready": len(texts)}
    assert all(fake.billed_count(t) == 1 for t in texts)  # no duplicate bill
    # The crash cost the claim's jobs a fault each, not an attempt.
    assert conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE faults = 1").fetchone()[0] == held
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs").fetchone()[0] == 1
    assert_vectors_match(conn, fake)
    assert assert_ledger_matches_bill(conn, fake, env) == 0


# 3 -------------------------------------------------------------------------
def test_crash_after_call_before_commit(env, fake, clean_db, corpus):
    write_corpus(corpus, 10)
    cli("ingest", str(corpus), env=env)
    crashing = crashing_worker(env, "after_call")
    wait_for_line(crashing, "CRASHPOINT after_call")
    kill_group(crashing)
    conn = clean_db
    billed_before = fake.stats["billed_inputs"]
    assert billed_before > 0  # the provider computed and billed...
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 0  # ...nothing committed
    # ...but the ledger had counted the send before it went out: unanswered, possibly billed.
    assert conn.execute("""SELECT outcome, billed, inputs, answered_at FROM app.provider_calls""").fetchall() == [
        ("sent", "maybe", billed_before, None)
    ]
    cli("work", "--until-idle", env=env)
    texts = chunk_texts(conn)
    assert job_counts(conn) == {"ready": len(texts)}
    # The duplicate spend is bounded: each input billed at most twice, once per crash.
    assert max(fake.billed_count(t) for t in texts) == 2
    assert fake.stats["billed_inputs"] == len(texts) + billed_before
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == len(texts)
    assert_vectors_match(conn, fake)
    assert assert_ledger_matches_bill(conn, fake, env) == billed_before


# 4 -------------------------------------------------------------------------
def test_timeout_ambiguity(env, fake, clean_db, corpus):
    """The provider computes and bills, then the connection drops: retried, stored once."""
    write_corpus(corpus, 5)
    cli("ingest", str(corpus), env=env)
    fake.drop_next(1)
    out = json.loads(cli("work", "--until-idle", "--json", env=env).stdout)
    conn = clean_db
    texts = chunk_texts(conn)
    assert job_counts(conn) == {"ready": len(texts)}
    # The drop is the request's fault: given back without an attempt, not retried.
    assert out["retried"] == 0 and out["embedded"] == len(texts)
    assert conn.execute("SELECT max(attempts), min(faults) FROM app.embedding_jobs").fetchone() == (1, 1)
    assert all(fake.billed_count(t) == 2 for t in texts)  # billed twice, stored once
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == len(texts)
    # The ledger saw the ambiguous send: status can report the duplicate spend.
    status = json.loads(cli("status", "--json", env=env).stdout)
    spend = next(iter(status["spend"].values()))
    assert spend["duplicate_inputs"] == len(texts)
    assert_vectors_match(conn, fake)
    assert assert_ledger_matches_bill(conn, fake, env) == len(texts)


# 5 -------------------------------------------------------------------------
def test_duplicate_event_creates_no_work(env, fake, clean_db, corpus):
    write_corpus(corpus, 8)
    first = json.loads(cli("ingest", str(corpus), "--json", env=env).stdout)
    conn = clean_db
    snapshot = conn.execute(JOBS_SNAPSHOT).fetchall()
    # The same documents with the same checksums observed again (a redelivered event)...
    again = json.loads(cli("ingest", str(corpus), "--json", env=env).stdout)
    assert again["new"] == again["changed"] == again["enqueued"] == 0 and again["unchanged"] == first["scanned"]
    # ...and the same content under another name: identical text is embedded once.
    shutil.copy(corpus / "doc0000.md", corpus / "copy-of-doc0000.md")
    copy_run = json.loads(cli("ingest", str(corpus), "--json", env=env).stdout)
    assert copy_run["new"] == 1 and copy_run["enqueued"] == 0
    after = conn.execute(JOBS_SNAPSHOT).fetchall()
    assert after == snapshot
    cli("work", "--until-idle", env=env)
    assert all(fake.billed_count(t) == 1 for t in chunk_texts(conn))
    exported = [json.loads(line) for line in cli("export", env=env).stdout.splitlines()]
    assert {r["document_id"] for r in exported} >= {"doc0000.md", "copy-of-doc0000.md"}


# 6 -------------------------------------------------------------------------
def test_stale_source_result_is_superseded(env, fake, clean_db, corpus):
    corpus.mkdir()
    doc = corpus / "moving.md"
    doc.write_text("SLOWDOC the first version of this document")
    cli("ingest", str(corpus), env=env)
    fake.slow_marker, fake.slow_seconds = "SLOWDOC", 15.0  # outlasts the ingest below on a loaded machine
    worker = start_cli("work", "--until-idle", "--json", env={**env, "PIPELINE_CALL_TIMEOUT": "60"})
    wait_until(lambda: fake.stats["requests"] >= 1, what="the provider call to start")
    # The document changes while its old version is being embedded.
    doc.write_text("the second version, edited during the call")
    cli("ingest", str(corpus), env=env)
    _out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    conn = clean_db
    old, new = "SLOWDOC the first version of this document", "the second version, edited during the call"
    assert fake.billed_count(old) == 1  # the old text was computed...
    rows = dict(
        conn.execute("""SELECT c.text, j.status FROM app.embedding_jobs j
                                LEFT JOIN app.chunks c ON c.chunk_checksum = j.chunk_checksum""").fetchall()
    )
    assert rows == {None: "superseded", new: "ready"}  # ...but never became current
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 1
    exported = [json.loads(line) for line in cli("export", env=env).stdout.splitlines()]
    assert [r["text"] for r in exported] == [new]


# 7 -------------------------------------------------------------------------
def test_expired_lease_late_completion_refused(env, fake, clean_db, corpus):
    corpus.mkdir()
    (corpus / "a.md").write_text("SLOWDOC a document whose worker stalls")
    cli("ingest", str(corpus), env=env)
    conn = clean_db
    fake.slow_marker, fake.slow_seconds = "SLOWDOC", 2.0
    stalled = start_cli(
        "work",
        "--until-idle",
        "--json",
        "--lease-seconds",
        "1",
        "--worker-id",
        "stalled",
        env={**env, "PIPELINE_CALL_TIMEOUT": "60"},
    )
    wait_until(lambda: fake.stats["requests"] >= 1, what="the stalled worker's call")
    os.killpg(stalled.pid, signal.SIGSTOP)  # the worker stalls: no heartbeat, no progress
    try:
        fake.slow_marker = None
        wait_until(
            lambda: conn.execute("SELECT lease_expires_at < now() FROM app.embedding_jobs").fetchone()[0],
            what="lease expiry",
        )
        taken = json.loads(cli("work", "--until-idle", "--json", "--worker-id", "rescuer", env=env).stdout)
        assert taken["embedded"] == 1 and taken["rescued"] >= 1
        # The stall cost a fault, not an attempt: one attempt for the rescuer's claim.
        assert conn.execute("SELECT status, attempts, faults FROM app.embedding_jobs").fetchone() == ("ready", 1, 1)
        stored_at = conn.execute("SELECT created_at FROM app.embeddings").fetchone()[0]
    finally:
        os.killpg(stalled.pid, signal.SIGCONT)
    out, err = stalled.communicate(timeout=60)
    assert stalled.returncode == 0, err
    late = json.loads(out)
    assert late["refused"] == 1 and late["embedded"] == 0  # the late completion was refused
    assert conn.execute("SELECT status FROM app.embedding_jobs").fetchone()[0] == "ready"
    assert conn.execute("SELECT created_at FROM app.embeddings").fetchone()[0] == stored_at  # not overwritten
    assert fake.billed_count("SLOWDOC a document whose worker stalls") == 2
    assert assert_ledger_matches_bill(conn, fake, env) == 1


# 8 -------------------------------------------------------------------------
def test_poison_input_dead_lettered_rest_completes(env, fake, clean_db, corpus):
    paths = write_corpus(corpus, 40)
    paths[7].write_text("this chunk is POISON to the provider")
    paths[21].write_text("this chunk always loses its connection DROPME")
    fake.poison_marker, fake.drop_marker = "POISON", "DROPME"
    env = {**env, "PIPELINE_MAX_ATTEMPTS": "3"}
    cli("embed", str(corpus), env=env)
    conn = clean_db
    failed = dict(
        conn.execute("""SELECT c.text, j.error_class || ':' || j.attempts FROM app.embedding_jobs j
                                  JOIN app.chunks c USING (chunk_checksum) WHERE j.status = 'failed'""").fetchall()
    )
    assert failed == {
        "this chunk is POISON to the provider": "bad_input:1",
        "this chunk always loses its connection DROPME": "connection:3",
    }
    texts = chunk_texts(conn)
    ready = conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0]
    assert ready == len(texts) - 2
    # Bounded cost: the retryable poison was sent at most MAX_EVIDENCE_FAULTS - 1 + FREE_FAULTS (free,
    # while the evidence against it grew and its requests shrank to itself) + max_attempts times, and a
    # neighbour once per failed send beside it, plus once more.
    free = MAX_EVIDENCE_FAULTS - 1 + FREE_FAULTS
    assert FREE_FAULTS + 3 <= fake.billed_count("this chunk always loses its connection DROPME") <= free + 3
    assert max(fake.billed_count(t) for t in texts if "DROPME" not in t) <= 1 + free
    dlq = json.loads(cli("dlq", "list", "--json", env=env).stdout)
    assert {(d["error_class"], tuple(d["documents"])) for d in dlq} == {
        ("bad_input", ("doc0007.md",)),
        ("connection", ("doc0021.md",)),
    }


# 9 -------------------------------------------------------------------------
def test_reconcile_repairs_missed_change_and_delete(env, fake, clean_db, corpus):
    paths = write_corpus(corpus, 6)
    cli("embed", str(corpus), env=env)
    conn = clean_db
    old_text = paths[1].read_text().strip()
    # Events were missed: a change and a delete that nobody ingested.
    paths[1].write_text("a changed document that no event announced")
    paths[2].unlink()
    report = json.loads(cli("reconcile", "--json", env=env).stdout)
    assert report["changed"] == 1 and report["deleted"] == 1 and report["enqueued"] >= 1
    cli("work", "--until-idle", env=env)
    exported = {
        r["document_id"]: r["text"] for r in (json.loads(line) for line in cli("export", env=env).stdout.splitlines())
    }
    assert "doc0002.md" not in exported
    assert exported["doc0001.md"] == "a changed document that no event announced"
    assert old_text not in exported.values()
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == len(exported)
    assert_vectors_match(conn, fake)
    again = json.loads(cli("reconcile", "--json", env=env).stdout)
    assert again["changed"] == again["deleted"] == again["enqueued"] == again["superseded"] == 0
