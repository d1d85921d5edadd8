"""Past one machine: many `work` processes on one PostgreSQL queue.

Four real worker processes (``python -m pipeline_assets.cli work``, each its own ``--worker-id``, as
replicas on four hosts would be) wait on an empty queue; then a corpus of a few hundred chunks is
ingested and they share it through the job table alone (``FOR UPDATE SKIP LOCKED``, leases), against
the fake OpenAI server (over HTTP, the real SDK) answering after a short latency, so calls overlap.

Pass: each job claimed exactly once (one attempt, one lease) and nothing sent twice: the provider
billed every chunk text exactly once, the spend ledger (``app.provider_calls``, ``app.input_sends``)
counts one send per input and agrees with the bill, every chunk has its provider vector, and all four
workers did part of the work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.processes import REPO, cli, wait_until

WORKERS = 4
DOCUMENTS = 300  # one chunk each
CONCURRENCY = 2
BATCH_INPUTS = 8
LATENCY = 0.15  # seconds per provider request: calls of all four workers overlap
MODEL_ID = f"openai/{FAKE_MODEL}"


def _start(i: int, env: dict, out, err) -> subprocess.Popen:
    """Output to files: a pipe nobody reads could fill up and block the worker."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline_assets.cli",
            "work",
            "--json",
            "--concurrency",
            str(CONCURRENCY),
            "--worker-id",
            f"host{i}",
        ],
        env=env,
        cwd=REPO,
        stdout=out,
        stderr=err,
        start_new_session=True,
    )


def _stopped(proc: subprocess.Popen) -> int | None:
    """Its exit code after SIGTERM; None if it had to be killed."""
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        return None


def test_four_worker_processes_share_one_queue_without_double_claims(env, fake, clean_db, tmp_path):
    conn = clean_db
    corpus = tmp_path / "corpus"
    write_corpus(corpus, DOCUMENTS)
    run_env = {**env, "PIPELINE_BATCH_INPUTS": str(BATCH_INPUTS)}
    fake.latency = LATENCY
    outs = [open(tmp_path / f"worker{i}.json", "w+") for i in range(WORKERS)]
    errs = [open(tmp_path / f"worker{i}.log", "w+") for i in range(WORKERS)]
    workers = [_start(i, run_env, outs[i], errs[i]) for i in range(WORKERS)]
    try:
        # The replicas are up (each beats in app.workers) before there is any work.
        wait_until(
            lambda: conn.execute("SELECT count(DISTINCT worker_id) FROM app.workers").fetchone()[0] == WORKERS,
            timeout=60,
            what="four live workers",
        )
        started = time.monotonic()
        cli("ingest", str(corpus), env=run_env)
        jobs = conn.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0]
        assert jobs == DOCUMENTS
        wait_until(lambda: job_counts(conn) == {"ready": jobs}, timeout=60, what="every job ready")
        drained = time.monotonic() - started
    finally:
        for proc in workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        codes = [_stopped(proc) for proc in workers]
    outputs, errors = [], []
    for out, err in zip(outs, errs):
        out.seek(0), err.seek(0)
        outputs.append(out.read())
        errors.append(err.read()[-2000:])
        out.close(), err.close()
    assert codes == [0] * WORKERS, errors

    texts = {t for (t,) in conn.execute("SELECT text FROM app.chunks")}
    assert len(texts) == DOCUMENTS
    # Claimed once per lease: one attempt each, no lease left behind.
    assert conn.execute("SELECT attempts, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall() == [(1, jobs)]
    assert conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE lease_owner IS NOT NULL").fetchone()[0] == 0
    if conn.execute("SELECT to_regclass('app.job_attempts') IS NOT NULL").fetchone()[0]:
        # The per-attempt history (sql/011) saw no rescue, retry or give-back.
        assert conn.execute("SELECT outcome, count(*) FROM app.job_attempts GROUP BY 1").fetchall() == []
    # The provider billed every chunk text exactly once, and nothing else.
    billed = {t: n for t, n in fake.stats["billed_by_text"].items() if t != "ping"}
    assert set(billed) == texts
    assert [t for t, n in billed.items() if n != 1] == []
    # The spend ledger agrees: one send per input, every call answered and billed once.
    sends = dict(
        conn.execute(
            "SELECT sends, count(*) FROM app.input_sends WHERE model_id = %s GROUP BY 1", (MODEL_ID,)
        ).fetchall()
    )
    assert sends == {1: jobs}
    calls = conn.execute(
        """SELECT worker_id, count(*), sum(inputs) FROM app.provider_calls
                            WHERE model_id = %s AND billed = 'yes' AND inputs > 0 GROUP BY 1 ORDER BY 1""",
        (MODEL_ID,),
    ).fetchall()
    assert sum(inputs for _, _, inputs in calls) == jobs
    assert (
        conn.execute(
            "SELECT count(*) FROM app.provider_calls WHERE answered_at IS NULL OR billed = 'maybe'"
        ).fetchone()[0]
        == 0
    )
    # All four did part of the work.
    per_worker = {w: inputs for w, _, inputs in calls}
    print(
        f"\n{WORKERS} workers drained {jobs} jobs in {drained:.1f} s; inputs per worker: {per_worker}; "
        f"requests: {fake.stats['requests']}"
    )
    assert sorted(per_worker) == [f"host{i}" for i in range(WORKERS)], per_worker
    # ... at the same time: calls of different workers were in flight together.
    overlapping = conn.execute("""SELECT count(*) FROM app.provider_calls a JOIN app.provider_calls b
                                  ON a.worker_id < b.worker_id AND a.called_at < b.answered_at
                                     AND b.called_at < a.answered_at""").fetchone()[0]
    assert overlapping > 0
    # Every vector is the provider's vector for its exact text.
    assert_vectors_match(conn, fake)
    # Each worker's own report agrees with the ledger.
    embedded = {}
    for i, out in enumerate(outputs):
        embedded[f"host{i}"] = json.loads(out)["embedded"]
    assert embedded == per_worker
