"""The dead-letter queue as a work list, through the real CLI against
the real PostgreSQL, with the fake OpenAI server injecting the faults: groups
with counts and first/last seen, one job's attempt history (written by the
trigger of sql/011 on failure transitions only), requeue by error class, and
discards that leave the work list, `requeue --all` and the growth check."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from pipeline_assets.app import dlq
from pipeline_assets.jobqueue import transitions
from pipeline_assets.providers import ModelSpec
from pipeline_assets.store import dead_letter_rows, queries, reports
from pipeline_assets_tests import job_helpers
from pipeline_assets_tests.data_helpers import job_counts, write_corpus
from pipeline_assets_tests.processes import cli

WORKER = "dlq-test-worker"
POISON = "POISON"


def cli_json(*args: str, env: dict):
    return json.loads(cli(*args, "--json", env=env).stdout)


@pytest.fixture
def corpus(tmp_path) -> Path:
    return tmp_path / "corpus"


def _job_of(conn, document_id: str) -> int:
    return conn.execute(
        """SELECT j.job_id FROM app.chunks c JOIN app.documents d USING (doc_pk)
                           JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum
                           JOIN app.embedding_jobs j ON j.job_id = k.job_id
                           WHERE d.document_id = %s""",
        (document_id,),
    ).fetchone()[0]


def test_dlq_groups_history_requeue_by_class_and_discard(env, fake, clean_db, corpus):
    conn = clean_db
    env = {**env, "PIPELINE_MAX_ATTEMPTS": "2", "PIPELINE_BATCH_INPUTS": "64"}
    write_corpus(corpus, 4)
    for name in ("poison1.md", "poison2.md"):
        (corpus / name).write_text(f"# {name}\n\nthis chunk carries the {POISON} word, {name}\n")
    (corpus / "blob.bin").write_bytes(b"\x00\x01\x02binary\x00" * 20)
    cli("ingest", str(corpus), env=env)

    # 1. The first request (all six inputs) is answered 500: the request's fault, given back
    #    without an attempt; then the poison inputs are refused (400) and dead-lettered as bad_input.
    fake.poison_marker = POISON
    fake.fail_next(1, 500)
    cli("work", "--until-idle", "--concurrency", "1", "--worker-id", WORKER, env=env)
    assert job_counts(conn) == {"ready": 4, "failed": 2}
    # 2. Two more documents meet nothing but 503s while the provider answers others: split down
    #    to themselves, then, alone past their free faults, their attempts (2) used up:
    #    dead-lettered as http_503.
    for i in range(2):
        (corpus / f"flaky{i}.md").write_text(f"# flaky {i}\n\nFLAKY503 the provider always fails this one {i}\n")
    cli("ingest", str(corpus), env=env)
    fake.error_marker = "FLAKY503"
    cli("work", "--until-idle", "--concurrency", "1", "--worker-id", WORKER, env=env)
    fake.error_marker = None
    assert job_counts(conn) == {"ready": 4, "failed": 4}

    groups = {(g["kind"], g["error_class"]): g for g in cli_json("dlq", "list", "--groups", env=env)}
    assert {k: g["items"] for k, g in groups.items()} == {
        ("job", "bad_input"): 2,
        ("job", "http_503"): 2,
        ("document", "unsupported_binary"): 1,
    }
    for g in groups.values():
        assert g["discarded"] == 0 and g["first_seen"] <= g["last_seen"]
    text = cli("dlq", "list", env=env).stdout
    assert re.search(r"job\s+bad_input\s+2\s+first ", text), text
    assert re.search(r"document\s+unsupported_binary\s+1\s+first ", text), text

    items = cli_json("dlq", "list", "--error-class", "bad_input", env=env)
    assert sorted(i["documents"][0] for i in items) == ["poison1.md", "poison2.md"]
    assert {i["kind"] for i in items} == {"job"}

    # 2. One job's attempts, in order: the 500 (given back: the request's fault, the attempt
    #    returned), then the 400 (failed, on that same attempt), by our worker.
    p1, p2 = _job_of(conn, "poison1.md"), _job_of(conn, "poison2.md")
    shown = cli_json("dlq", "show", str(p1), env=env)
    history = shown["history"]
    assert [(a["attempt"], a["outcome"], a["status"], a["error_class"]) for a in history] == [
        (1, "given_back", "pending", "http_500"),
        (1, "failed", "failed", "bad_input"),
    ]
    assert {a["worker"] for a in history} == {WORKER}
    assert all(a["lease"].startswith(f"{WORKER}/") for a in history)
    assert history[0]["at"] <= history[1]["at"]
    assert all("test-key" not in (a["message"] or "") for a in history)  # sanitized: never the key
    assert shown["documents"] == ["poison1.md"] and shown["status"] == "failed"
    out = cli("dlq", "show", str(p1), env=env).stdout
    assert f"worker={WORKER}" in out and "[bad_input]" in out and "[http_500]" in out

    # 3. Discard: all or nothing; the discarded job leaves the list, the growth count, --all.
    bad = cli("dlq", "discard", str(p2), "999999", "--reason", "x", env=env, check=False)
    assert bad.returncode == 1 and bad.stderr.startswith("error: ") and len(bad.stderr.splitlines()) == 1
    assert "999999" in bad.stderr and conn.execute("SELECT count(*) FROM app.dlq_discards").fetchone()[0] == 0
    recent_before, total_before = reports.dead_letter_growth(conn)
    done = cli(
        "dlq",
        "discard",
        str(p1),
        "--reason",
        "upstream text is garbage; key sk-abcdef123456 test-key",
        "--by",
        "alice",
        env=env,
    )
    assert done.stdout.strip() == "discarded jobs=1 documents=0"
    assert reports.dead_letter_growth(conn) == (recent_before - 1, total_before - 1)
    assert reports.dead_letter_discarded(conn) == 1
    st = cli_json("status", env=env)
    assert (st["dead_letter"], st["dead_letter_discarded"]) == (4, 1)
    [gone] = cli_json("dlq", "list", "--discarded", env=env)
    assert gone["id"] == p1 and gone["discarded"]["by"] == "alice"
    assert gone["discarded"]["reason"] == "upstream text is garbage; key [redacted] [redacted]"
    assert p1 not in [i["id"] for i in cli_json("dlq", "list", "--error-class", "bad_input", env=env)]
    groups = {(g["kind"], g["error_class"]): g for g in cli_json("dlq", "list", "--groups", env=env)}
    assert (groups[("job", "bad_input")]["items"], groups[("job", "bad_input")]["discarded"]) == (1, 1)
    assert cli_json("dlq", "show", str(p1), env=env)["history"][-1]["outcome"] == "discarded"
    assert re.search(r"discarded\s+-> failed\s+by=alice", cli("dlq", "show", str(p1), env=env).stdout)

    # 4. After the fix: requeue one class; a healthy worker makes exactly those ready.
    fake.poison_marker = None
    assert cli("dlq", "requeue", "--error-class", "http_503", env=env).stdout.startswith("requeued=2 ")
    assert job_counts(conn) == {"ready": 4, "failed": 2, "pending": 2}
    assert cli("dlq", "requeue", "--all", env=env).stdout.startswith("requeued=1 ")  # p2, not the discarded p1
    cli("work", "--until-idle", "--worker-id", WORKER, env=env)
    status = dict(conn.execute("SELECT job_id, status FROM app.embedding_jobs").fetchall())
    assert status.pop(p1) == "failed" and set(status.values()) == {"ready"}
    poison1 = conn.execute(
        "SELECT c.text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = 'poison1.md'"
    ).fetchone()[0]
    assert fake.billed_count(poison1) == 0  # the discarded input was never sent again
    assert cli("dlq", "requeue", "--all", env=env).stdout.startswith("requeued=0 ")

    # 5. Named, a discarded job is requeued anyway, and its discard is lifted.
    assert cli("dlq", "requeue", str(p1), "--by", "bob", env=env).stdout.startswith("requeued=1 ")
    assert reports.dead_letter_discarded(conn) == 0 and cli_json("dlq", "list", "--discarded", env=env) == []
    cli("work", "--until-idle", "--worker-id", WORKER, env=env)
    assert job_counts(conn) == {"ready": 8} and fake.billed_count(poison1) == 1
    outcomes = [(a["outcome"], a["worker"]) for a in cli_json("dlq", "show", str(p1), env=env)["history"]]
    assert outcomes[-2:] == [("discarded", "alice"), ("requeued", "bob")]


def test_dlq_quarantined_documents_requeue_by_class_and_discard(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 2)
    (corpus / "huge.txt").write_text("big " * 1500)
    (corpus / "blob.bin").write_bytes(b"\x00\x01\x02binary\x00" * 20)
    small = {**env, "PIPELINE_MAX_INPUT_BYTES": "4000"}
    cli("embed", str(corpus), env=small)

    shown = cli_json("dlq", "show", "huge.txt", env=small)
    [src] = shown["sources"]
    assert src["status"] == "quarantined" and src["error_class"] == "too_large"
    assert any(s["stage"] == "extract" and s["error_class"] == "too_large" for s in src["stages"])
    assert cli("dlq", "show", "nope.md", env=small, check=False).stderr.startswith("error: no job or document")

    assert (
        cli("dlq", "discard", "blob.bin", "--reason", "not text, never will be", env=small).stdout.strip()
        == "discarded jobs=0 documents=1"
    )
    groups = {(g["kind"], g["error_class"]): g for g in cli_json("dlq", "list", "--groups", env=small)}
    assert (
        groups[("document", "unsupported_binary")]["items"],
        groups[("document", "unsupported_binary")]["discarded"],
    ) == (0, 1)
    assert (
        cli("dlq", "requeue", "--error-class", "unsupported_binary", env=small).stdout.strip()
        == "requeued=0 superseded=0 documents=0 still_quarantined=0"
    )

    # The limit raised (the fix), the class requeued: re-extracted, chunked, then embedded.
    assert (
        cli("dlq", "requeue", "--error-class", "too_large", env=env).stdout.strip()
        == "requeued=0 superseded=0 documents=1 still_quarantined=0"
    )
    assert conn.execute("SELECT status FROM app.documents WHERE document_id = 'huge.txt'").fetchone()[0] == "current"
    cli("work", "--until-idle", env=env)
    assert set(job_counts(conn)) == {"ready"}
    assert [i["id"] for i in cli_json("dlq", "list", "--items", env=env)] == []
    assert [i["id"] for i in cli_json("dlq", "list", "--discarded", env=env)] == ["blob.bin"]
    # Other bytes, quarantined again: a new failure, so the discard is lifted.
    (corpus / "blob.bin").write_bytes(b"\x00\x09other binary\x00" * 20)
    cli("ingest", str(corpus), env=env)
    assert cli_json("dlq", "list", "--discarded", env=env) == []
    assert [i["id"] for i in cli_json("dlq", "list", "--items", env=env)] == ["blob.bin"]


# -- the history trigger, without the CLI ----------------------------------------------------

SPEC = ModelSpec(
    provider="test", name="dlq", dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
)


def _seed(conn, texts: list[str], max_attempts: int) -> list[int]:
    from pipeline_assets.registry import models

    models.ensure_model(conn, SPEC)
    source_id = conn.execute("INSERT INTO app.sources (root) VALUES ('/dlq') RETURNING source_id").fetchone()[0]
    doc_pk = conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status)"
        " VALUES (%s, 'd', 'file:///d', 'current') RETURNING doc_pk",
        (source_id,),
    ).fetchone()[0]
    for i, t in enumerate(texts):
        conn.execute(
            "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start,"
            " char_end) VALUES (%s, %s, %s, %s, 1, 0, 1)",
            (doc_pk, i, hashlib.sha256(t.encode()).digest(), t),
        )
    transitions.enqueue_for_docs(conn, [doc_pk], max_attempts)
    return [r[0] for r in conn.execute("SELECT job_id FROM app.embedding_jobs ORDER BY job_id")]


def test_history_is_bounded_and_the_success_path_writes_none(clean_db):
    conn = clean_db
    assert conn.execute("SELECT app.job_attempts_kept()").fetchone()[0] == dlq.ATTEMPTS_KEPT_PER_JOB
    model = SPEC.model_id
    ok, flaky = _seed(conn, ["fine", "flaky"], max_attempts=100)
    # The success path: claim, complete. No history row, no trigger call.
    [job] = transitions.claim(conn, model_id=model, owner="w/x/1", limit=1, lease_seconds=30)
    assert job.job_id == ok
    job_helpers.complete(conn, owner="w/x/1", job_ids=[ok], vectors=[np.ones(4, dtype=np.float32)])
    # A plain give-back (shutdown) is not a failure either.
    transitions.claim(conn, model_id=model, owner="w/x/2", limit=1, lease_seconds=30)
    job_helpers.give_back(conn, owner="w/x/2", job_ids=[flaky])
    assert conn.execute("SELECT count(*) FROM app.job_attempts").fetchone()[0] == 0

    n = dlq.ATTEMPTS_KEPT_PER_JOB + 5
    for i in range(n):
        [j] = transitions.claim(conn, model_id=model, owner=f"w/x/{i + 3}", limit=1, lease_seconds=30)
        job_helpers.fail_retryable(
            conn, owner=f"w/x/{i + 3}", job_ids=[j.job_id], delays=[0.0], error_class="http_503", message=f"failure {i}"
        )
    rows = conn.execute(
        "SELECT attempt, outcome, error_message FROM app.job_attempts WHERE job_id = %s ORDER BY attempt_id", (flaky,)
    ).fetchall()
    assert len(rows) == dlq.ATTEMPTS_KEPT_PER_JOB
    assert rows[0] == (6, "retry", "failure 5") and rows[-1] == (n, "retry", f"failure {n - 1}")
    # A throttle and a rescue say so.
    [j] = transitions.claim(conn, model_id=model, owner="w/x/t", limit=1, lease_seconds=30)
    job_helpers.give_back(conn, owner="w/x/t", job_ids=[flaky], error_class="throttled", message="429", throttled=True)
    [j] = transitions.claim(conn, model_id=model, owner="w/x/r", limit=1, lease_seconds=0)
    conn.execute("SELECT pg_sleep(0.01)")
    transitions.rescue_expired(conn)
    last = conn.execute(
        "SELECT outcome, actor, error_class FROM app.job_attempts WHERE job_id = %s ORDER BY attempt_id DESC LIMIT 2",
        (flaky,),
    ).fetchall()
    assert last == [("rescued", "w/x/r", "lease_expired"), ("throttled", "w/x/t", "throttled")]
    assert (
        conn.execute("SELECT count(*) FROM app.job_attempts WHERE job_id = %s", (flaky,)).fetchone()[0]
        == dlq.ATTEMPTS_KEPT_PER_JOB
    )


def test_every_dlq_query_is_used():
    source = (Path(dead_letter_rows.__file__)).read_text()
    unused = [n for n in queries.load("dlq").names() if not re.search(rf"\bDLQ\.{n}\b", source)]
    assert not unused, unused
    assert dlq.worker_of("host:12/0f8fad5b-d9cb-469f-a165-70867728950e/7") == "host:12"
    assert dlq.worker_of("alice") == "alice"
