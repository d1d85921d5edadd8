"""The spend ledger counts every send, whatever happens after it.

Each send is recorded before the request goes out; its outcome settles it. The
ledger's duplicate sends must equal the provider's duplicate bills: after a
refusal (not billed), after a failure between the answer and the commit, and
after a kill mid-call (test_contract.py, test_liveness.py).
"""

from __future__ import annotations

import json

import numpy as np

from pipeline_assets.jobqueue import ledger
from pipeline_assets.jobqueue.changes import Complete
from pipeline_assets.jobqueue.job_store import Answer
from pipeline_assets.jobqueue.pg_job_store import PostgresJobStore
from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import models
from pipeline_assets.store import db
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.integration.test_state_machine import claim_ids, drop_chunks, seed
from pipeline_assets_tests.processes import cli

MODEL_ID = f"openai/{FAKE_MODEL}"


def ledger_extra_sends(conn) -> int:
    return conn.execute("SELECT coalesce(sum(sends - 1) FILTER (WHERE sends > 1), 0) FROM app.input_sends").fetchone()[
        0
    ]


def provider_extra_bills(fake) -> int:
    return sum(n - 1 for n in fake.stats["billed_by_text"].values() if n > 1)


def test_a_refused_send_is_taken_back(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 3)
    cli("ingest", str(tmp_path / "c"), env=env)
    fake.fail_next(1, 500)  # answered 500: not billed
    cli("work", "--until-idle", env=env)
    conn = clean_db
    calls = conn.execute("SELECT outcome, billed, tokens, inputs FROM app.provider_calls ORDER BY call_id").fetchall()
    assert [(o, b, t) for o, b, t, _ in calls[:1]] == [("http_500", "no", 0)]
    # After the 500, one trivial check ("ping": does the provider answer anyone?), then the answers.
    assert all((o, b) in {("ok", "yes"), ("health_probe", "yes")} for o, b, _, _ in calls[1:])
    assert sum(n for o, _, _, n in calls if o == "ok") == fake.stats["billed_inputs"] - fake.billed_count("ping")
    assert {r[0] for r in conn.execute("SELECT sends FROM app.input_sends")} == {1}  # sent twice, billed once
    assert ledger_extra_sends(conn) == provider_extra_bills(fake) == 0
    spend = json.loads(cli("status", "--json", env=env).stdout)["spend"][MODEL_ID]
    assert (spend["duplicate_inputs"], spend["extra_sends"], spend["tokens"]) == (0, 0, fake.stats["billed_tokens"])


def test_a_send_whose_completion_never_commits_is_still_counted(env, fake, clean_db, tmp_path):
    """The provider answers (and bills), then storing the vectors fails: the
    call's outcome never commits, but its send was counted before it went out."""
    write_corpus(tmp_path / "c", 4)
    env = {**env, "PIPELINE_MAX_ATTEMPTS": "2"}
    cli("ingest", str(tmp_path / "c"), env=env)
    conn = clean_db
    conn.execute("""CREATE OR REPLACE FUNCTION app.test_refuse_vectors() RETURNS trigger LANGUAGE plpgsql
                    AS $$ BEGIN RAISE EXCEPTION 'vectors refused by the test'; END $$""")
    conn.execute("""CREATE TRIGGER test_refuse_vectors BEFORE INSERT ON app.embeddings
                    FOR EACH ROW EXECUTE FUNCTION app.test_refuse_vectors()""")
    try:
        cli("work", "--until-idle", "--concurrency", "1", env=env, check=False, timeout=60)
    finally:
        conn.execute("DROP TRIGGER test_refuse_vectors ON app.embeddings")
        conn.execute("DROP FUNCTION app.test_refuse_vectors()")
    billed_while_refused = fake.stats["billed_inputs"]
    assert billed_while_refused > 0 and conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 0
    unsettled = conn.execute(
        "SELECT count(*), sum(inputs) FROM app.provider_calls WHERE answered_at IS NULL"
    ).fetchone()
    assert unsettled == (fake.stats["requests"], billed_while_refused)  # every answered call, still counted
    cli("dlq", "requeue", "--all", env=env)  # in case the failures were charged to the items
    cli("work", "--until-idle", env=env)
    texts = [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks")]
    assert job_counts(conn) == {"ready": len(texts)}
    assert_vectors_match(conn, fake)
    assert provider_extra_bills(fake) == billed_while_refused
    assert ledger_extra_sends(conn) == provider_extra_bills(fake)


def test_send_then_outcome_row_by_row(conn):
    """record_send counts before the call; record_outcome settles once; a refusal takes the sends back;
    a run's budget counts the other runs' unanswered sends at their estimate."""
    conn.execute("TRUNCATE app.provider_calls, app.input_sends_until_032")
    model, a, b = "test/ledger@2", b"\x01" * 32, b"\x02" * 32

    def sends() -> dict:
        return {bytes(k): n for k, n in conn.execute("SELECT chunk_checksum, sends FROM app.input_sends")}

    lost = ledger.record_send(conn, model_id=model, worker_id="w", checksums=[a, b], tokens=50, worker_run="run-1/")
    assert sends() == {a: 1, b: 1}
    assert ledger.tokens_today(conn, model) == 50  # possibly billed, at its estimate
    assert ledger.tokens_today(conn, model, excluding_run="run-2/") == 50  # another run counts it
    assert ledger.tokens_today(conn, model, excluding_run="run-1/") == 0  # its own run counts answers
    refused = ledger.record_send(conn, model_id=model, worker_id="w", checksums=[a], tokens=25, worker_run="run-2/")
    assert sends() == {a: 2, b: 1}
    for _ in range(2):  # settled once: a second outcome changes nothing
        ledger.record_outcome(
            conn, call_id=refused, outcome="http_429", status=429, latency=0.1, billed=ledger.NOT_BILLED, tokens=0
        )
    assert sends() == {a: 1, b: 1}
    answered = ledger.record_send(conn, model_id=model, worker_id="w", checksums=[a, b], tokens=50, worker_run="run-2/")
    ledger.record_outcome(
        conn, call_id=answered, outcome="ok", status=200, latency=0.2, billed=ledger.BILLED, tokens=48
    )
    assert sends() == {a: 2, b: 2}  # the lost send and the answered one: duplicate spend
    rows = conn.execute(
        "SELECT call_id, outcome, billed, tokens, answered_at IS NULL FROM app.provider_calls ORDER BY call_id"
    ).fetchall()
    assert rows == [
        (lost, "sent", "maybe", 50, True),
        (refused, "http_429", "no", 0, False),
        (answered, "ok", "yes", 48, False),
    ]
    assert ledger.tokens_today(conn, model) == 98


def test_an_answer_settles_completes_and_supersedes_in_one_statement(clean_db, database_url):
    """A successful answer is one statement in autocommit (jobs.sql complete): the
    call settled (answered, billed, the provider's tokens), the held jobs whose
    content is wanted ready with their vectors, the one whose content went away
    superseded, the one whose lease was lost untouched; the sends counted before
    the call stay counted once. The same answer again (a retry of the statement
    after an ambiguous commit) changes nothing and settles nothing twice."""
    conn = clean_db
    spec = ModelSpec(
        provider="test", name="m", dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
    )
    models.ensure_model(conn, spec)
    ids = seed(conn, 4)
    owner = "run/1"
    assert sorted(claim_ids(conn, owner=owner)) == sorted(ids)
    keep, also, gone, stolen = ids
    drop_chunks(conn, gone)
    conn.execute("UPDATE app.embedding_jobs SET lease_owner = 'run/2' WHERE job_id = %s", (stolen,))
    checksums = dict(
        conn.execute("SELECT job_id, chunk_checksum FROM app.embedding_jobs WHERE job_id = ANY(%s)", (ids,)).fetchall()
    )
    call = ledger.record_send(
        conn, model_id=spec.model_id, worker_id="w", checksums=[checksums[i] for i in ids], tokens=40
    )
    vectors = tuple(np.full(4, i, dtype=np.float32) for i in range(4))
    seen: list[tuple] = []

    class Seen:
        def applied(self, change, became):
            seen.append((type(change).__name__, change.job_ids, became))

    pool = db.make_pool(database_url, min_size=1, max_size=1)
    try:
        store = PostgresJobStore(
            pool, model_id=spec.model_id, worker_id="w", backoff_base=1, backoff_cap=1, observers=[Seen()]
        )
        answer = Answer(call, tokens=37, latency=0.25)
        first = store.apply(owner, [Complete(tuple(ids), vectors)], answer=answer)
        settled = conn.execute(
            "SELECT outcome, http_status, billed, tokens, latency_ms, answered_at"
            " FROM app.provider_calls WHERE call_id = %s",
            (call,),
        ).fetchone()
        again = store.apply(owner, [Complete(tuple(ids), vectors)], answer=answer)
    finally:
        pool.close()
    assert first == {keep: "ready", also: "ready", gone: "superseded"}
    assert again == {}
    assert settled[:5] == ("ok", 200, "yes", 37, 250)
    assert (
        conn.execute("SELECT answered_at FROM app.provider_calls WHERE call_id = %s", (call,)).fetchone()[0]
        == settled[5]
    )  # settled once
    assert seen[:2] == [
        ("Complete", tuple(ids), {keep: "ready", also: "ready"}),
        ("Supersede", (gone, stolen), {gone: "superseded"}),
    ]
    rows = dict(conn.execute("SELECT job_id, status FROM app.embedding_jobs WHERE job_id = ANY(%s)", (ids,)))
    assert rows == {keep: "ready", also: "ready", gone: "superseded", stolen: "processing"}
    stored = {
        bytes(c): list(e.to_numpy()) for c, e in conn.execute("SELECT chunk_checksum, embedding FROM app.embeddings")
    }
    assert stored == {bytes(checksums[keep]): [0.0] * 4, bytes(checksums[also]): [1.0] * 4}
    assert [r[0] for r in conn.execute("SELECT sends FROM app.input_sends")] == [1] * 4


def test_sends_counted_before_032_are_added_to_the_calls(conn):
    """Migration 032 moved the count into the call rows; the counts written before it
    (app.input_sends_until_032) still count, added to the calls' own."""
    conn.execute("TRUNCATE app.provider_calls, app.input_sends_until_032")
    model, a, b = "test/ledger@032", b"\x03" * 32, b"\x04" * 32
    conn.execute(
        "INSERT INTO app.input_sends_until_032 (chunk_checksum, model_id, sends) VALUES (%s, %s, 2)", (a, model)
    )
    ledger.record_send(conn, model_id=model, worker_id="w", checksums=[a, b], tokens=2)
    refused = ledger.record_send(conn, model_id=model, worker_id="w", checksums=[b], tokens=1)
    ledger.record_outcome(
        conn, call_id=refused, outcome="http_500", status=500, latency=0.1, billed=ledger.NOT_BILLED, tokens=0
    )
    sends = {
        bytes(k): n
        for k, n in conn.execute("SELECT chunk_checksum, sends FROM app.input_sends WHERE model_id = %s", (model,))
    }
    assert sends == {a: 3, b: 1}
    inputs = conn.execute("SELECT inputs, cardinality(checksums) FROM app.provider_calls ORDER BY call_id").fetchall()
    assert inputs == [(2, 2), (1, 1)]
