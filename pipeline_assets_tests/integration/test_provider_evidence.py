"""Provider faults judged on evidence, black-box: the real ``pipeline-assets work`` (in process or as a
real process), the real openai SDK, the fake provider as a real HTTP server and the real PostgreSQL;
assertions are on rows, vectors, the ledger and the fake's bill.

* One input the provider never answers (a proxy leaves its vector out of every answer) is
  dead-lettered alone, within the stated bound on its sends; its 39 neighbours complete.
* A provider answering nothing usable, even to one trivial input, stops the worker with one line, and
  the stop survives restarts: a restarted worker asks one trivial input and stops without billing more.
* Failures spread across every request (random 429s and 500s) are the provider's: requests are not
  shrunk to single inputs and the corpus completes; a poison input is still isolated, sends bounded.
* After an outage longer than the backoff cap, the first request reaches the provider within 10 s of
  its recovery (the fake records when each request arrived).
"""

from __future__ import annotations

import json
import time

import pytest

from pipeline_assets.jobqueue.breaker_config import BREAKER_PROBE_INTERVAL
from pipeline_assets.jobqueue.decisions import MAX_UNMATCHED_ANSWERS
from pipeline_assets.jobqueue.evidence import MAX_EVIDENCE_FAULTS
from pipeline_assets.jobqueue.provider_checks import CHECK_TRIES
from pipeline_assets.jobqueue.request_plan import FREE_FAULTS
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.processes import cli, start_cli, stop_group, wait_until

MAX_ATTEMPTS = 5
# The stated bound on the sends of an input that breaks every request holding it (docs/state-machine.md).
SENDS_BOUND = MAX_EVIDENCE_FAULTS - 1 + FREE_FAULTS + MAX_ATTEMPTS
HANG_SECONDS = 300.0
PROBE = "ping"  # the worker's trivial input (the configuration and health checks)


def _texts(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks ORDER BY 1")]


def _billed(fake) -> dict[str, int]:
    return {t: n for t, n in fake.stats["billed_by_text"].items() if t != PROBE}


def _ledger_sends(conn, text: str) -> int:
    return conn.execute(
        "SELECT s.sends FROM app.input_sends s JOIN app.chunks c USING (chunk_checksum) WHERE c.text = %s", (text,)
    ).fetchone()[0]


def test_an_input_left_out_of_every_answer_is_dead_lettered_alone(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 39)
    (tmp_path / "c" / "filtered.md").write_text("# filtered\n\nFILTERME a proxy leaves this vector out\n")
    run_env = {**env, "PIPELINE_MAX_ATTEMPTS": str(MAX_ATTEMPTS)}
    cli("ingest", str(tmp_path / "c"), env=run_env)
    conn = clean_db
    texts = _texts(conn)
    assert len(texts) == 40
    (bad,) = [t for t in texts if "FILTERME" in t]
    fake.omit_marker = "FILTERME"
    cli("work", "--until-idle", env=run_env, timeout=HANG_SECONDS)
    assert job_counts(conn) == {"ready": 39, "failed": 1}
    row = conn.execute("""SELECT j.error_class, j.attempts, c.text FROM app.embedding_jobs j
                          JOIN app.chunks c USING (chunk_checksum) WHERE j.status = 'failed'""").fetchone()
    assert row == ("bad_response", MAX_ATTEMPTS, bad)
    sends = fake.billed_count(bad)  # an answer that left it out was billed: every send is on the bill
    print(
        f"\nfiltered input: {sends} sends (bound {SENDS_BOUND}); requests={fake.stats['requests']}, "
        f"omitted={fake.stats['omitted']}"
    )
    assert MAX_ATTEMPTS <= sends <= SENDS_BOUND
    assert _ledger_sends(conn, bad) == sends  # the ledger counted each of them
    billed = _billed(fake)
    assert set(billed) == set(texts)
    # A neighbour is billed once per request it shared with the filtered input before that went alone, plus once.
    assert max(n for t, n in billed.items() if t != bad) <= sends - MAX_ATTEMPTS + 1
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 39
    rows = conn.execute(
        "SELECT DISTINCT c.text FROM app.chunks c JOIN app.embeddings e USING (chunk_checksum)"
    ).fetchall()
    assert bad not in {r[0] for r in rows}


def test_a_provider_answering_nothing_usable_stops_the_worker_across_restarts(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 20)
    cli("ingest", str(tmp_path / "c"), env=env)
    conn = clean_db
    texts = _texts(conn)
    fake.short_rate = 1.0  # every answer one embedding short, even an answer to a single input
    first = cli("work", "--until-idle", env=env, check=False, timeout=HANG_SECONDS)
    lines = first.stderr.strip().splitlines()
    assert first.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: unmatched_answers: "), first.stderr
    assert f"{MAX_UNMATCHED_ANSWERS} answers in a row" in lines[0]
    after_stop = _billed(fake)
    print(f"\nfirst run: {sum(after_stop.values())} inputs billed, {fake.stats['requests']} requests")
    assert after_stop and max(after_stop.values()) <= MAX_UNMATCHED_ANSWERS
    # A restart policy restarts it: each restart asks one trivial input and stops again, billing no input.
    for restart in range(3):
        again = cli("work", "--until-idle", env=env, check=False, timeout=HANG_SECONDS)
        lines = again.stderr.strip().splitlines()
        assert again.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: unmatched_answers: "), (
            again.stderr
        )
        assert _billed(fake) == after_stop, f"restart {restart} billed inputs again"
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 0
    assert set(job_counts(conn)) <= {"pending", "retry"}
    assert conn.execute("SELECT max(attempts) FROM app.embedding_jobs").fetchone()[0] == 0
    fake.short_rate = 0.0  # the proxy is fixed: the next start finds the provider usable and completes
    cli("work", "--until-idle", env=env, timeout=HANG_SECONDS)
    assert job_counts(conn) == {"ready": len(texts)}
    assert_vectors_match(conn, fake)


HARSH = [[0.5, 429, "1"], [0.3, 500, None]]


def test_random_provider_wide_failures_do_not_shrink_requests(env, fake, clean_db, tmp_path):
    """50% of requests 429 (Retry-After: 1), 30% 500, at random: the provider's, so the
    requests keep their size (none goes out with a single input) and the corpus completes."""
    write_corpus(tmp_path / "c", 100)
    run_env = {**env, "PIPELINE_BATCH_INPUTS": "32"}
    cli("ingest", str(tmp_path / "c"), env=run_env)
    conn = clean_db
    texts = _texts(conn)
    fake.random_faults = HARSH
    fake.fault_seed = 11
    out = cli("work", "--until-idle", "--json", env=run_env, timeout=HANG_SECONDS)
    sizes = [r[0] for r in conn.execute("SELECT inputs FROM app.provider_calls WHERE inputs > 0 ORDER BY call_id")]
    stats = fake.stats
    print(
        f"\nharsh: requests={stats['requests']} by_status={stats['responses_by_status']} sizes={sizes} "
        f"report={json.loads(out.stdout)}"
    )
    assert job_counts(conn) == {"ready": len(texts)}
    assert stats["responses_by_status"].get(429, 0) > 0 and stats["responses_by_status"].get(500, 0) > 0
    assert min(sizes) > 1, "a request was shrunk to a single input by random provider-wide failures"
    assert stats["billed_inputs"] == len(texts)  # 429 and 500 are not billed: nothing billed twice
    assert_vectors_match(conn, fake)


def test_a_poison_input_under_random_failures_is_isolated_with_bounded_sends(env, fake, clean_db, tmp_path):
    write_corpus(tmp_path / "c", 60)
    (tmp_path / "c" / "poison.md").write_text("# poison\n\nDROPME every request holding this is cut off\n")
    run_env = {
        **env,
        "PIPELINE_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
        "PIPELINE_BATCH_INPUTS": "16",
        "PIPELINE_CALL_TIMEOUT": "60",
    }
    cli("ingest", str(tmp_path / "c"), env=run_env)
    conn = clean_db
    texts = _texts(conn)
    (poison,) = [t for t in texts if "DROPME" in t]
    fake.configure(drop_marker="DROPME", random_faults=[[0.3, 429, "1"], [0.1, 500, None]], fault_seed=3)
    cli("work", "--until-idle", env=run_env, timeout=HANG_SECONDS)
    assert job_counts(conn) == {"ready": len(texts) - 1, "failed": 1}
    sends = fake.billed_count(poison)
    print(f"\npoison under random failures: {sends} sends (bound {SENDS_BOUND}); requests={fake.stats['requests']}")
    assert sends <= SENDS_BOUND
    assert _ledger_sends(conn, poison) == sends


BACKOFF_CAP = 60.0  # the default
OUTAGE_SECONDS = BACKOFF_CAP + 5  # longer than the backoff cap


def test_the_first_probe_after_an_outage_reaches_the_provider_within_seconds(env, fake, clean_db, tmp_path):
    """503 to everything for longer than the backoff cap: once the provider is back, the
    first request reaches it within 10 s (the breaker's probe interval is capped), and
    the corpus completes."""
    write_corpus(tmp_path / "c", 60)
    run_env = {**env, "PIPELINE_BACKOFF_BASE": "1", "PIPELINE_BACKOFF_CAP": str(BACKOFF_CAP)}
    cli("ingest", str(tmp_path / "c"), env=run_env)
    conn = clean_db
    texts = _texts(conn)
    fake.random_faults = [[1.0, 503, None]]
    worker = start_cli("work", env=run_env)
    try:
        # The worker met the outage: the breaker tripped (5 failures in a row).
        wait_until(
            lambda: conn.execute("SELECT tripped FROM app.provider_state").fetchone() == (True,),
            timeout=HANG_SECONDS,
            what="the breaker to trip",
        )
        outage_started = time.time()
        wait_until(
            lambda: time.time() - outage_started >= OUTAGE_SECONDS,
            timeout=OUTAGE_SECONDS + 10,
            interval=0.5,
            what="the outage to last",
        )
        during = fake.stats["requests"]
        fake.random_faults = []
        recovered = time.time()
        first = wait_until(
            lambda: [t for t in fake.stats["arrivals"] if t >= recovered],
            timeout=HANG_SECONDS,
            what="a request after the recovery",
        )[0]
        wait_until(
            lambda: job_counts(conn) == {"ready": len(texts)}, timeout=HANG_SECONDS, what="the corpus to complete"
        )
        done = time.time()
    finally:
        stop_group(worker)
    print(
        f"\noutage: {during} requests in {OUTAGE_SECONDS + (recovered - outage_started - OUTAGE_SECONDS):.0f} s; "
        f"first request {first - recovered:.1f} s after recovery, complete {done - recovered:.1f} s after"
    )
    assert first - recovered <= 10.0
    # Not hammered: once the breaker tripped, a probe per pause (at least half the probe interval),
    # not a request per claim loop; before it, at most a check (CHECK_TRIES trivial requests) per failure.
    assert during <= (OUTAGE_SECONDS + 10) / (BREAKER_PROBE_INTERVAL / 2) + 5 * (1 + CHECK_TRIES) + 10
    assert_vectors_match(conn, fake)


@pytest.fixture(autouse=True)
def _no_faults_left(fake):
    yield
    fake.clear_faults()
