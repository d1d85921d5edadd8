"""Provider faults charged where the evidence says, black-box: the real ``pipeline-assets work``
process, the real openai SDK, the fake provider as a real HTTP server on 127.0.0.1 and the real
PostgreSQL; every assertion is on rows, stored vectors and the provider's bill.

* Dropped answers (billed, then the connection cut) on batched requests dead-letter nobody; each costs
  one more bill per input it carried, no more.
* A poison input (every request holding it dropped) is dead-lettered alone, after at most
  ``MAX_EVIDENCE_FAULTS - 1 + FREE_FAULTS + max_attempts`` sends.
* A proxy that drops an embedding from every answer, even to one trivial input, stops the worker with
  one line after a few answers: nothing stored or dead-lettered, no attempt used; once fixed, a rerun
  completes. ``PIPELINE_DROP_RUNS``: the dropped-answer check's seeds (default 3; 20 to be thorough).
"""

from __future__ import annotations

import os
import time

import pytest

from pipeline_assets.jobqueue.decisions import MAX_UNMATCHED_ANSWERS
from pipeline_assets.jobqueue.evidence import MAX_EVIDENCE_FAULTS
from pipeline_assets.jobqueue.request_plan import FREE_FAULTS
from pipeline_assets.jobqueue.worker_config import DEFAULT_CONCURRENCY
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.processes import cli

DOCUMENTS = 60
DROP_RATE = 0.3
DROP_RUNS = int(os.environ.get("PIPELINE_DROP_RUNS", "3"))
BATCH_INPUTS = 8  # many requests per run (the default 256 would send the 60 inputs as one)
MAX_ATTEMPTS = 5  # the default: the bound on a poison input's sends below counts this
POISON_SENDS_BOUND = MAX_EVIDENCE_FAULTS - 1 + FREE_FAULTS + MAX_ATTEMPTS  # docs/state-machine.md: 18
# The per-call deadline in these runs: the faults here are dropped connections (cut at once), and a
# timeout is a fault too, so the tests' 5 s deadline would add faults of the machine's load to the
# fake's on a busy machine (an innocent input dead-lettered under load 10).
CALL_TIMEOUT = "60"
# Against a hang only: that the worker stops after a few broken answers is asserted by counting
# them (below), not by the clock, which a loaded machine stretches.
PROXY_STOP_SECONDS = 300.0


def _texts(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks ORDER BY 1")]


def assert_vectors_match_except(conn, fake, text: str) -> None:
    """Every current chunk but ``text`` has exactly the provider's vector for its own text."""
    import numpy as np

    rows = conn.execute(
        """SELECT DISTINCT c.text, e.embedding FROM app.chunks c
                           JOIN app.embeddings e USING (chunk_checksum) WHERE c.text <> %s""",
        (text,),
    ).fetchall()
    assert rows and all(np.allclose(np.asarray(v.to_numpy()), fake.vector_for(t), atol=1e-6) for t, v in rows)


def _billed(fake) -> tuple[int, dict[str, int]]:
    by_text = {t: n for t, n in fake.stats["billed_by_text"].items() if t != "ping"}  # the config probe
    return sum(by_text.values()), by_text


@pytest.mark.parametrize("seed", range(DROP_RUNS))
def test_dropped_answers_dead_letter_nothing(env, fake, clean_db, tmp_path, seed):
    write_corpus(tmp_path / "c", DOCUMENTS)
    run_env = {
        **env,
        "PIPELINE_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
        "PIPELINE_BATCH_INPUTS": str(BATCH_INPUTS),
        "PIPELINE_CALL_TIMEOUT": CALL_TIMEOUT,
    }
    cli("ingest", str(tmp_path / "c"), env=run_env)
    conn = clean_db
    texts = _texts(conn)
    fake.configure(drop_rate=DROP_RATE, fault_seed=1000 + seed)
    out = cli("work", "--until-idle", "--json", env=run_env, timeout=300)
    stats = fake.stats
    print(
        f"\nseed {seed}: requests={stats['requests']} dropped={stats['dropped']} "
        f"({stats['dropped_inputs']} inputs) billed={stats['billed_inputs']} unique={len(texts)} "
        f"{out.stdout.strip()}"
    )
    failed = conn.execute(
        "SELECT error_class, attempts, faults FROM app.embedding_jobs WHERE status = 'failed'"
    ).fetchall()
    assert job_counts(conn) == {"ready": len(texts)}, f"dead-lettered: {failed}"
    assert_vectors_match(conn, fake)
    # Extra bills: exactly one per input of each dropped answer (it is sent again), none otherwise
    # (a dropped trivial check, "ping", is not an input of the corpus: the ledger counts those).
    billed, by_text = _billed(fake)
    dropped_checks = conn.execute(
        "SELECT count(*) FROM app.provider_calls WHERE inputs = 0 AND billed = 'maybe'"
    ).fetchone()[0]
    assert billed == len(texts) + stats["dropped_inputs"] - dropped_checks
    assert set(by_text) == set(texts)


def test_a_poison_input_is_dead_lettered_alone_with_bounded_sends(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", DOCUMENTS)
    (tmp_path / "c" / "poison.md").write_text("# poison\n\nDROPME every request holding this is cut off\n")
    run_env = {**env, "PIPELINE_MAX_ATTEMPTS": str(MAX_ATTEMPTS), "PIPELINE_CALL_TIMEOUT": CALL_TIMEOUT}
    cli("ingest", str(tmp_path / "c"), env=run_env)
    conn = clean_db
    texts = _texts(conn)
    (poison,) = [t for t in texts if "DROPME" in t]
    fake.configure(drop_marker="DROPME", drop_rate=DROP_RATE, fault_seed=7)
    cli("work", "--until-idle", env=run_env, timeout=300)
    assert job_counts(conn) == {"ready": len(texts) - 1, "failed": 1}
    row = conn.execute("""SELECT j.error_class, j.attempts, j.faults, c.text FROM app.embedding_jobs j
                          JOIN app.chunks c USING (chunk_checksum) WHERE j.status = 'failed'""").fetchone()
    assert row[:2] == ("connection", MAX_ATTEMPTS) and FREE_FAULTS <= row[2] < MAX_EVIDENCE_FAULTS + FREE_FAULTS
    assert row[3] == poison
    sends = fake.billed_count(poison)  # a dropped request is billed: every send of it is on the bill
    print(f"\npoison: {sends} sends (bound {POISON_SENDS_BOUND}); requests={fake.stats['requests']}")
    assert sends <= POISON_SENDS_BOUND
    ledger = conn.execute(
        "SELECT s.sends FROM app.input_sends s JOIN app.chunks c USING (chunk_checksum) WHERE c.text = %s", (poison,)
    ).fetchone()[0]
    assert ledger == sends  # the spend ledger counted each of them
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == len(texts) - 1
    assert_vectors_match_except(conn, fake, poison)


@pytest.mark.parametrize(
    "fault",
    [
        # every answer one embedding short, its other indexes intact
        pytest.param(("short_rate", "short", "got "), id="one-embedding-short"),
        # the right count, but one index twice and one missing: which vector is whose?
        pytest.param(("bad_index_rate", "bad_index", "got indexes "), id="duplicate-index"),
    ],
)
def test_a_proxy_that_drops_an_embedding_stops_the_worker_then_a_rerun_completes(env, fake, clean_db, tmp_path, fault):
    rate, counted, says = fault
    write_corpus(tmp_path / "c", 20)
    cli("ingest", str(tmp_path / "c"), env=env)
    conn = clean_db
    texts = _texts(conn)
    setattr(fake, rate, 1.0)
    started = time.monotonic()
    proc = cli("work", "--until-idle", env=env, check=False, timeout=PROXY_STOP_SECONDS + 30)
    wall = time.monotonic() - started
    print(f"\nbroken proxy: stopped after {wall:.1f}s, {fake.stats['requests']} requests: {proc.stderr.strip()}")
    assert proc.returncode != 0 and wall < PROXY_STOP_SECONDS
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unmatched_answers: "), proc.stderr
    assert f"{MAX_UNMATCHED_ANSWERS} answers in a row" in lines[0] and says in lines[0]
    assert "Traceback" not in proc.stderr
    # It stops after MAX_UNMATCHED_ANSWERS in a row, each confirmed by one trivial input answered
    # unusably too; requests the other claim threads had in flight then may still come back (at
    # most concurrency - 1 more), never another round of them.
    broken = conn.execute("SELECT count(*) FROM app.provider_calls WHERE inputs > 0").fetchone()[0]
    checks = conn.execute("SELECT count(*) FROM app.provider_calls WHERE inputs = 0").fetchone()[0]
    assert MAX_UNMATCHED_ANSWERS <= broken <= MAX_UNMATCHED_ANSWERS + DEFAULT_CONCURRENCY - 1
    assert checks == MAX_UNMATCHED_ANSWERS and fake.stats[counted] == broken + checks
    # Nothing stored (no vector on the wrong text), nothing dead-lettered, no attempt or fault charged.
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 0
    assert set(job_counts(conn)) <= {"pending", "retry"}
    assert conn.execute("SELECT max(attempts), max(faults) FROM app.embedding_jobs").fetchone() == (0, 0)
    # The answers were billed: the ledger counts them as (possibly) billed.
    assert (
        conn.execute(
            "SELECT count(*) FROM app.provider_calls WHERE billed IN ('yes', 'maybe') AND inputs > 0"
        ).fetchone()[0]
        == broken
    )
    setattr(fake, rate, 0.0)  # the proxy is fixed
    cli("work", "--until-idle", env=env, timeout=120)
    assert job_counts(conn) == {"ready": len(texts)}
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs").fetchone()[0] == 1
    assert_vectors_match(conn, fake)
