"""A worker's crash is attributed like a transient fault: not the items' unless one
keeps crashing its worker alone.

Real worker processes frozen at a crashpoint (``after_call``: the provider answered
and billed, nothing committed) and killed with SIGKILL, as an OOM kill or a fleet
redeploy would; the next worker rescues the dead claims. A crash gives each job it
held its attempt back and counts a fault on it (its next requests are smaller); a
job is charged an attempt only when it was alone in the dead claim after
``FREE_FAULTS`` faults, so a batch of innocent jobs survives repeated crashes and a
poison input (one that crashes every worker sending it) is dead-lettered alone after
at most ``FREE_FAULTS + max_attempts`` sends.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline_assets.jobqueue.request_plan import FREE_FAULTS
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.e2e.test_contract import assert_ledger_matches_bill
from pipeline_assets_tests.processes import cli, kill_group, start_cli, wait_for_line

MAX_ATTEMPTS = 3


def crash_once(env: dict, crashpoint: str, concurrency: int = 1) -> bool:
    """Run a worker until it reaches ``crashpoint`` and SIGKILL it (True), or until it finishes (False)."""
    worker = start_cli(
        "work",
        "--until-idle",
        "--concurrency",
        str(concurrency),
        "--lease-seconds",
        "1",
        env={**env, "PIPELINE_CRASHPOINT": crashpoint},
    )
    try:
        wait_for_line(worker, "CRASHPOINT after_call")
    except AssertionError:
        worker.wait(timeout=60)
        return False
    kill_group(worker)
    return True


def test_repeated_crashes_do_not_dead_letter_innocent_jobs(env, fake, clean_db, tmp_path):
    """More crashes with the batch held than it has attempts (a worker OOM-killed, a fleet
    redeployed): every job ends ready, none failed."""
    corpus = tmp_path / "c"
    write_corpus(corpus, 8)
    env = {**env, "PIPELINE_MAX_ATTEMPTS": str(MAX_ATTEMPTS)}
    cli("ingest", str(corpus), env=env)
    conn = clean_db
    texts = [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks")]
    crashes = MAX_ATTEMPTS + 1
    assert crashes < FREE_FAULTS  # what is asserted is the fault rule, not its last resort
    for n in range(crashes):
        assert crash_once(env, "after_call"), f"crash {n + 1}: the worker found nothing to do: {job_counts(conn)}"
        assert "failed" not in job_counts(conn)
    done = json.loads(cli("work", "--until-idle", "--json", "--lease-seconds", "1", env=env).stdout)
    assert job_counts(conn) == {"ready": len(texts)}
    # Each crash cost a fault, not an attempt: the last claim was the only one charged.
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs").fetchone()[0] == 1
    assert done["rescued"] >= 1
    history = conn.execute("SELECT outcome, error_class, count(*) FROM app.job_attempts GROUP BY 1, 2").fetchall()
    assert {(o, e) for o, e, _ in history} == {("rescued", "lease_expired")}, history
    assert_vectors_match(conn, fake)
    assert_ledger_matches_bill(conn, fake, env)


# One thread on a small corpus (the ledger agrees with the bill exactly); four threads on a corpus
# that keeps them all busy, so innocent claims are in flight beside the poison's on every crash.
@pytest.mark.parametrize("concurrency, documents", [(1, 6), (4, 30)])
def test_an_input_that_crashes_its_worker_alone_is_dead_lettered_within_the_bound(
    env, fake, clean_db, tmp_path, concurrency, documents
):
    """Alone in its worker process too: with several threads, the claims of the others are over before
    a suspect's runs, so no neighbour is charged for its crash."""
    corpus = tmp_path / "c"
    write_corpus(corpus, documents)
    (corpus / "poison.md").write_text("OOMPOISON this input kills any worker that sends it")
    env = {**env, "PIPELINE_MAX_ATTEMPTS": str(MAX_ATTEMPTS), "PIPELINE_BATCH_INPUTS": "4"}
    fake.latency = 0.2  # the other threads' calls are in flight when the poison's worker dies
    cli("ingest", str(corpus), env=env)
    conn = clean_db
    texts = [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks")]
    [poison] = [t for t in texts if "OOMPOISON" in t]
    bound = FREE_FAULTS + MAX_ATTEMPTS
    crashes = 0
    while crash_once(env, "after_call:OOMPOISON", concurrency):
        crashes += 1
        held = conn.execute(
            """SELECT j.attempts, j.faults FROM app.embedding_jobs j
                               JOIN app.chunks c USING (chunk_checksum) WHERE c.text = %s""",
            (poison,),
        ).fetchone()
        assert crashes <= bound, (
            f"{crashes} crashes and the poison is not dead-lettered: {job_counts(conn)}, its (attempts, faults): {held}"
        )
    print(f"\npoison dead-lettered after {crashes} crashes, sent {fake.billed_count(poison)} times (bound {bound})")
    # The poison alone is dead-lettered, within the bound; its neighbours are ready.
    assert job_counts(conn) == {"ready": len(texts) - 1, "failed": 1}
    failed = conn.execute("""SELECT c.text, j.attempts, j.faults, j.error_class FROM app.embedding_jobs j
                             JOIN app.chunks c USING (chunk_checksum) WHERE j.status = 'failed'""").fetchone()
    # A fault per crash until it is a suspect, then a charge per crash (none a fault: it was alone).
    assert failed[0] == poison and failed[1] == MAX_ATTEMPTS and failed[2] == FREE_FAULTS, failed
    assert failed[3] == "lease_expired", failed
    assert crashes == fake.billed_count(poison) <= bound
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0] == 1
    stored = conn.execute(
        "SELECT c.text, e.embedding FROM app.embeddings e JOIN app.chunks c USING (chunk_checksum)"
    ).fetchall()
    assert sorted(t for t, _ in stored) == sorted(t for t in texts if t != poison)
    assert all(np.allclose(v.to_numpy(), fake.vector_for(t), atol=1e-6) for t, v in stored)
    if concurrency == 1:
        assert_ledger_matches_bill(conn, fake, env)
    else:  # a killed worker's other threads may have recorded sends that never reached the provider
        ledger = conn.execute("SELECT coalesce(sum(sends - 1), 0) FROM app.input_sends").fetchone()[0]
        unknown = conn.execute(
            "SELECT coalesce(sum(inputs), 0) FROM app.provider_calls WHERE answered_at IS NULL"
        ).fetchone()[0]
        billed = sum(n - 1 for n in fake.stats["billed_by_text"].values())
        assert billed <= ledger <= billed + unknown
    # Its history tells the story: a rescue per crash, the last ones charged.
    outcomes = [
        r[0]
        for r in conn.execute("""SELECT a.outcome FROM app.job_attempts a
                                              JOIN app.embedding_jobs j USING (job_id)
                                              WHERE j.status = 'failed' ORDER BY a.attempt_id""")
    ]
    assert outcomes == ["rescued"] * crashes
