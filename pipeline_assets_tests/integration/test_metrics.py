"""`work --metrics-port`: a real worker process against the fake provider with
429s injected, scraped over HTTP while it runs; the counters must match what
the fake provider saw and the jobs-by-status gauge what the database holds."""

from __future__ import annotations

import signal
import socket
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import job_counts, write_corpus
from pipeline_assets_tests.processes import cli, start_cli, wait_until

MODEL_ID = f"openai/{FAKE_MODEL}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _try_scrape(port: int):
    try:
        return scrape(port)
    except (urllib.error.URLError, ConnectionError):
        return None


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_work_metrics_match_the_provider_and_the_database(env, fake, clean_db, tmp_path):
    conn = clean_db
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 30)
    cli("ingest", str(corpus), env=env)
    wanted = sum(job_counts(conn).values())
    assert wanted >= 30
    fake.latency = 0.05  # long enough to scrape while it works
    fake.fail_next(3, 429, retry_after="0.3")
    port = _free_port()
    proc = start_cli(
        "work",
        "--concurrency",
        "2",
        "--metrics-port",
        str(port),
        "--worker-id",
        "metrics-w1",
        env={**env, "PIPELINE_BATCH_INPUTS": "4"},
    )
    try:
        first = wait_until(lambda port=port: _try_scrape(port), timeout=60, what="the metrics endpoint")
        # While it runs: the gauges and counters are there (the worker may still be starting).
        assert ("pipeline_jobs_claimed_total", ()) in first
        assert any(n == "pipeline_provider_latency_seconds_bucket" for n, _ in first)
        wait_until(lambda: job_counts(conn).get("ready", 0) == wanted, timeout=120, what="every job ready")

        def settled():  # the jobs gauge is cached from the database for a moment: until it shows that
            sample = scrape(port)
            gauge = {dict(ls)["status"]: v for (n, ls), v in sample.items() if n == "pipeline_jobs"}
            return sample if gauge == job_counts(conn) else None

        m = wait_until(settled, timeout=60, interval=0.2, what="the jobs gauge to show every job ready")
        stats = fake.stats
        assert proc.poll() is None, "the worker is still running (it was not started --until-idle)"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err

    # Provider counters: exactly what the fake provider saw.
    assert stats["responses_by_status"].get(429) == 3
    assert total(m, "pipeline_provider_requests_total") == stats["requests"]
    assert total(m, "pipeline_provider_requests_total", status="429") == 3
    assert total(m, "pipeline_provider_throttled_total") == 3
    assert total(m, "pipeline_provider_requests_total", status="200") == stats["responses_by_status"][200]
    assert total(m, "pipeline_provider_latency_seconds_count") == stats["requests"]
    assert total(m, "pipeline_provider_latency_seconds_sum") >= 0.05 * stats["requests"]
    assert total(m, "pipeline_provider_tokens_total") == stats["billed_tokens"]
    assert total(m, "pipeline_provider_inputs_total") >= stats["billed_inputs"] == wanted

    # The worker's counters: every job embedded once by this process; claims include the throttled ones.
    assert total(m, "pipeline_worker_jobs_total", outcome="embedded") == wanted
    assert total(m, "pipeline_worker_jobs_total", outcome="throttled") >= 3
    assert total(m, "pipeline_jobs_claimed_total") >= wanted + 3
    assert total(m, "pipeline_lease_rescues_total") == 0
    assert total(m, "pipeline_worker_info", worker_id="metrics-w1", model=MODEL_ID) == 1
    assert total(m, "pipeline_superseded_results_total") == 0

    # The jobs gauge is the database's, and the breaker closed again after the 429s.
    in_db = {status: n for status, n in job_counts(conn).items()}
    assert {dict(ls)["status"]: v for (n, ls), v in m.items() if n == "pipeline_jobs"} == in_db
    assert total(m, "pipeline_breaker_state", model=MODEL_ID, state="closed") == 1
    assert total(m, "pipeline_breaker_state", model=MODEL_ID, state="open") == 0

    # The summary on stdout agrees with the scrape.
    assert f"provider_calls={stats['requests']}" in out


def test_metrics_bind_to_localhost_unless_told(env, fake, clean_db):
    """127.0.0.2 is loopback too, but not the address bound by default: a server on
    every interface answers there, one on 127.0.0.1 does not."""
    for host_args, reachable_elsewhere in (((), False), (("--metrics-host", "0.0.0.0"), True)):
        port = _free_port()
        proc = start_cli("work", "--metrics-port", str(port), *host_args, env=env)
        try:
            wait_until(lambda port=port: _try_scrape(port), timeout=60, what="the metrics endpoint")
            with socket.socket() as s:
                s.settimeout(2)
                assert (s.connect_ex(("127.0.0.2", port)) == 0) is reachable_elsewhere, host_args
            m = scrape(port)
            assert total(m, "pipeline_provider_requests_total") == 0  # nothing to do: nothing called
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
        assert proc.returncode == 0


def test_a_scrape_without_the_database_repeats_the_last_values(database_url, clean_db):
    """The pool's only connection is taken: the scrape waits 2 s at most, repeats what it
    read last and counts the error, and reads again once the database is there."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pipeline_assets.app.metrics import DatabaseCollector
    from pipeline_assets.store import db

    clean_db.execute("INSERT INTO app.models (model_id, provider, name) VALUES ('m', 'test', 'm')")
    clean_db.execute(
        "INSERT INTO app.provider_state (model_id, tripped, paused_until) VALUES ('m', true, now() + interval '1 hour')"
    )
    pool = db.make_pool(database_url, min_size=1, max_size=1)
    try:
        collector = DatabaseCollector(pool, cache_seconds=0.0)
        registry = CollectorRegistry()
        registry.register(collector)

        def read() -> dict:
            text = generate_latest(registry).decode()
            return {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
            }

        first = read()
        assert total(first, "pipeline_breaker_state", model="m", state="open") == 1
        with pool.connection():  # the pool's only connection: the collector cannot get one
            started = time.monotonic()
            stale = read()
            assert time.monotonic() - started < 30  # the collector gave up waiting for a connection
        assert total(stale, "pipeline_metrics_database_errors_total") == 1
        assert total(stale, "pipeline_breaker_state", model="m", state="open") == 1  # the last values
        clean_db.execute(
            "UPDATE app.provider_state SET tripped = false, paused_until = '-infinity' WHERE model_id = 'm'"
        )
        fresh = read()
        assert total(fresh, "pipeline_breaker_state", model="m", state="closed") == 1
        assert total(fresh, "pipeline_metrics_database_errors_total") == 1
    finally:
        pool.close()
