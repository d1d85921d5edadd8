"""Structured logs: a real `work` process whose stderr is a pipe writes JSON
lines, and the lines about jobs (a dead letter, retries) carry the job id, the
document id, the attempt and the worker id; never the key, never document text.
`--log-format text` writes readable lines with the same context."""

from __future__ import annotations

import json

from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli

KEY = "sk-logtestkey1234567890"
POISON = "POISONED"


def _corpus(tmp_path, fake):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 6)
    (corpus / "bad.md").write_text(f"# bad\n\nthis secret prose {POISON} must never reach a log line\n")
    fake.poison_marker = POISON  # a 400 for that input: split until it is alone, then dead-lettered
    fake.api_key = KEY
    return corpus


def test_piped_stderr_is_json_lines_with_the_job_context(env, fake, clean_db, tmp_path):
    corpus = _corpus(tmp_path, fake)
    env = {**env, "OPENAI_API_KEY": KEY, "PIPELINE_BATCH_INPUTS": "8"}
    cli("ingest", str(corpus), env=env)
    fake.fail_next(1, 500)  # one retryable failure too (logged at INFO: -v)
    proc = cli("-v", "work", "--until-idle", "--worker-id", "log-w1", env=env)
    lines = proc.stderr.splitlines()
    assert lines, "the worker logged nothing"
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n{proc.stderr}") from None
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)

    about_jobs = [r for r in records if "job_id" in r]
    dead = [r for r in about_jobs if "dead-lettered" in r["message"]]
    assert len(dead) == 1, about_jobs
    (d,) = dead
    assert d["level"] == "warning" and d["document_id"] == "bad.md" and d["worker_id"] == "log-w1"
    failed_job = clean_db.execute(
        "SELECT job_id, attempts, error_class FROM app.embedding_jobs WHERE status = 'failed'"
    ).fetchall()
    assert failed_job == [(d["job_id"], d["attempt"], d["error_class"])]  # the 500 may have cost it one attempt
    retried = [r for r in about_jobs if "will retry" in r["message"]]
    assert retried, "the 500 was not logged per job"
    for r in about_jobs:  # every line about a job carries its context
        assert {"job_id", "document_id", "attempt", "worker_id"} <= set(r), r
        assert r["worker_id"] == "log-w1" and r["attempt"] >= 1 and r["document_id"].endswith(".md")
    assert KEY not in proc.stderr and "secret prose" not in proc.stderr and POISON not in proc.stderr


def test_text_format_is_readable_and_carries_the_context(env, fake, clean_db, tmp_path):
    corpus = _corpus(tmp_path, fake)
    env = {**env, "OPENAI_API_KEY": KEY}
    cli("ingest", str(corpus), env=env)
    proc = cli("--log-format", "text", "work", "--until-idle", "--worker-id", "log-w2", env=env)
    (line,) = [ln for ln in proc.stderr.splitlines() if "dead-lettered" in ln]
    assert " WARNING pipeline_assets.jobqueue: job dead-lettered" in line
    assert "document_id=bad.md" in line and "worker_id=log-w2" in line and "attempt=1" in line
    assert "job_id=" in line
    for ln in proc.stderr.splitlines():
        assert not ln.startswith("{"), ln
    assert KEY not in proc.stderr and "secret prose" not in proc.stderr
