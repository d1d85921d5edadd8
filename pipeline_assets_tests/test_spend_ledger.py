"""The spend ledger counts every send, whatever happens after it (issue 8, item 6).

Each send is recorded before the request goes out; its outcome settles it. The
ledger's duplicate sends must equal the provider's duplicate bills: after a
refusal (not billed), after a failure between the answer and the commit, and
after a kill mid-call (test_contract.py, test_liveness.py).
"""

from __future__ import annotations

import json

from pipeline_assets_tests.conftest import FAKE_MODEL, assert_vectors_match, cli, job_counts, write_corpus

MODEL_ID = f"openai/{FAKE_MODEL}"


def ledger_extra_sends(conn) -> int:
    return conn.execute("SELECT coalesce(sum(sends - 1) FILTER (WHERE sends > 1), 0) FROM app.input_sends"
                        ).fetchone()[0]


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
    assert all((o, b) == ("ok", "yes") for o, b, _, _ in calls[1:])
    assert sum(n for o, _, _, n in calls if o == "ok") == fake.stats["billed_inputs"]
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
    unsettled = conn.execute("SELECT count(*), sum(inputs) FROM app.provider_calls WHERE answered_at IS NULL"
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
    from pipeline_assets.jobs import ledger

    conn.execute("TRUNCATE app.provider_calls, app.input_sends")
    model, a, b = "test/ledger@2", b"\x01" * 32, b"\x02" * 32

    def sends() -> dict:
        return {bytes(k): n for k, n in conn.execute("SELECT chunk_checksum, sends FROM app.input_sends")}

    lost = ledger.record_send(conn, model_id=model, worker_id="w", checksums=[a, b], tokens=50, run="run-1/")
    assert sends() == {a: 1, b: 1}
    assert ledger.tokens_today(conn, model) == 50                          # possibly billed, at its estimate
    assert ledger.tokens_today(conn, model, excluding_run="run-2/") == 50  # another run counts it
    assert ledger.tokens_today(conn, model, excluding_run="run-1/") == 0   # its own run counts answers
    refused = ledger.record_send(conn, model_id=model, worker_id="w", checksums=[a], tokens=25, run="run-2/")
    assert sends() == {a: 2, b: 1}
    for _ in range(2):  # settled once: a second outcome changes nothing
        ledger.record_outcome(conn, call_id=refused, model_id=model, checksums=[a], outcome="http_429", status=429,
                              latency=0.1, billed=ledger.NOT_BILLED, tokens=0)
    assert sends() == {a: 1, b: 1}
    answered = ledger.record_send(conn, model_id=model, worker_id="w", checksums=[a, b], tokens=50, run="run-2/")
    ledger.record_outcome(conn, call_id=answered, model_id=model, checksums=[a, b], outcome="ok", status=200,
                          latency=0.2, billed=ledger.BILLED, tokens=48)
    assert sends() == {a: 2, b: 2}  # the lost send and the answered one: duplicate spend
    rows = conn.execute("SELECT call_id, outcome, billed, tokens, answered_at IS NULL FROM app.provider_calls "
                        "ORDER BY call_id").fetchall()
    assert rows == [(lost, "sent", "maybe", 50, True), (refused, "http_429", "no", 0, False),
                    (answered, "ok", "yes", 48, False)]
    assert ledger.tokens_today(conn, model) == 98
