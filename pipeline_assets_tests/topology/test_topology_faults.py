"""The production topology's faults between hosts (root only): a worker host cut off mid-call,
PostgreSQL restarted and then read-only, latency and loss on every worker host's link to the db
host. No Dagster deployment: each scenario drains a database of its own on the db host through
PgBouncer. Each asserts outcomes: rows, vectors, bills; the figures go to
``topology-figures.json`` (scenarios.FIGURES).
"""

from __future__ import annotations

import json
import sys
import time

import psycopg
import pytest

from pipeline_assets_tests.conftest import LONG_PROFILE
from pipeline_assets_tests.processes import wait_until
from pipeline_assets_tests.topology.scenarios import (
    FIGURES,
    assert_vectors,
    billed_for,
    copy_database,
    counts,
    drain,
    load,
    metric,
    new_database,
    reconnect,
    round_trip_s,
    scalar,
)
from pipeline_assets_tests.topology.services import missing_requirements

_why_not = missing_requirements()
pytestmark = [pytest.mark.skipif(_why_not is not None, reason=_why_not or ""), pytest.mark.timeout(900)]

WITH_DAGSTER = False
# One-chunk documents. The short profile checks the outcomes (every job ready, one vector each,
# billed once) on one drain of 1,200 through the slowed links; the long profile's two rounds of 2,400
# (a clean drain and a slowed one each, then the relay's control: five drains) give the throughput
# figure of docs/benchmarks.md.
LATENCY_JOBS = 2400 if LONG_PROFILE else 1200
LATENCY_BATCH = 8
LATENCY_ROUNDS = 2 if LONG_PROFILE else 1
THROUGHPUT = LONG_PROFILE  # the clean drains and the relay's control, for the figure only
LINK_DELAY_S, LINK_LOSS, LINK_RTO_S = 0.05, 0.01, 0.2  # one way; per packet (relay: per chunk); Linux's min RTO


# ---- scenarios ----------------------------------------------------------------------------------
def test_partition_a_worker_host_cut_off_mid_call(topo):
    """One worker host's link goes down while its requests are at the provider, for longer than
    its lease: the others rescue and finish its jobs; when the link is back its late answers are
    fenced (refused or superseded), no vector is stored twice, and the extra bill is at most the
    inputs it had in flight (docs/state-machine.md, duplicate spend)."""
    docs, batch, concurrency, lease = 240, 8, 2, 4
    conn = new_database(topo, "part", docs)
    topo.provider_faults(latency=1.0)
    cut = topo.worker_hosts[-1]
    opts = {"PIPELINE_BATCH_INPUTS": str(batch), "PIPELINE_WORKER_DEAD_AFTER": "2", "PIPELINE_CALL_TIMEOUT": "60"}
    args = ("--concurrency", str(concurrency), "--lease-seconds", str(lease))
    worker_id = f"{cut}-part"

    def start(host: str):
        metrics = ("--metrics-port", "9108", "--metrics-host", topo.addr(host)) if host == cut else ()
        return topo.start_worker(host, "part", *args, *metrics, **opts)

    procs = [start(cut)]
    try:
        # The cut-off host alone first: both its requests are at the provider when its link goes down.
        wait_until(
            lambda: scalar(conn, "SELECT count(*) FROM app.workers") >= 1,
            timeout=120,
            interval=0.2,
            what="the worker to register",
        )
        before = topo.provider_stats()["requests"]
        conn.execute("UPDATE app.embedding_jobs SET available_at = now()")
        wait_until(
            lambda: topo.provider_stats()["requests"] >= before + concurrency,
            timeout=60,
            interval=0.02,
            what="the cut-off host's requests to reach the provider",
        )
        topo.lab.link_down(cut)
        down_at = time.monotonic()
        procs += [start(h) for h in topo.worker_hosts if h != cut]
        held = scalar(
            conn,
            "SELECT count(*) FROM app.embedding_jobs WHERE status = 'processing' AND lease_owner LIKE %s",
            (worker_id + "/%",),
        )
        wait_until(
            lambda: scalar(conn, "SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'") == docs,
            timeout=180,
            interval=0.2,
            what="the other hosts to finish the cut-off host's jobs",
        )
        rescued = scalar(conn, "SELECT count(*) FROM app.job_attempts WHERE outcome = 'rescued'")
        time.sleep(max(0.0, 2 * lease - (time.monotonic() - down_at)))  # the cut outlasts the lease
        down_s = time.monotonic() - down_at
        topo.lab.link_up(cut)
        fenced = wait_until(
            lambda: (
                metric(topo, cut, 9108, 'pipeline_worker_jobs_total{outcome="refused"}')
                + metric(topo, cut, 9108, 'pipeline_worker_jobs_total{outcome="superseded"}')
            ),
            timeout=120,
            interval=0.5,
            what="the cut-off host's late answers to be fenced",
        )
        assert all(p.poll() is None for p in procs), [topo.log_tail(f"worker-{h}-part") for h in topo.worker_hosts]
    finally:
        topo.lab.link_up(cut)
        topo.stop_workers(procs)
        topo.provider_faults(latency=0.0)
    assert counts(conn) == {"ready": docs}
    assert_vectors(conn)
    billed = billed_for(topo, "part")
    extra = sum(billed.values()) - docs
    ledger = scalar(conn, "SELECT coalesce(sum(sends - 1), 0) FROM app.input_sends")
    FIGURES["partition"] = {
        "held_at_cut": held,
        "rescued": rescued,
        "fenced": fenced,
        "down_s": round(down_s, 1),
        "extra_bill_inputs": extra,
        "ledger_duplicates": ledger,
        "bound": concurrency * batch,
        "load": load(),
    }
    assert held > 0 and rescued >= 1 and fenced >= 1, FIGURES["partition"]
    assert len(billed) == docs
    assert 0 <= extra <= concurrency * batch, FIGURES["partition"]
    assert ledger >= extra, "the ledger counts every possibly billed send"
    conn.close()


def test_database_restarted_and_read_only_for_20_seconds(topo):
    """PostgreSQL restarted mid-drain, then read-only for 20 s (a failover): the worker hosts wait
    it out, charge nothing, and finish; nothing dead-lettered, every input billed once."""
    docs = 600
    conn = new_database(topo, "restart", docs)
    topo.provider_faults(latency=0.2)
    opts = {"PIPELINE_BATCH_INPUTS": "8", "PIPELINE_WORKER_DEAD_AFTER": "3"}
    procs = [topo.start_worker(h, "restart", "--concurrency", "2", **opts) for h in topo.worker_hosts]
    ready_sql = "SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'"
    try:
        wait_until(
            lambda: scalar(conn, "SELECT count(*) FROM app.workers") >= 3,
            timeout=120,
            interval=0.2,
            what="the workers to register",
        )
        conn.execute("UPDATE app.embedding_jobs SET available_at = now()")
        wait_until(lambda: scalar(conn, ready_sql) >= docs // 6, timeout=120, interval=0.1, what="some progress")
        conn.close()
        topo.pg_ctl("restart", "-m", "fast", "-w", "-t", "120")
        conn = reconnect(topo, "restart")
        wait_until(
            lambda: scalar(conn, ready_sql) >= docs // 2, timeout=180, interval=0.2, what="progress after the restart"
        )
        with topo.admin() as admin:
            admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            admin.execute("SELECT pg_reload_conf()")
        read_only_from = scalar(conn, ready_sql)
        time.sleep(20)  # the fault's length, as the scenario states it
        during = scalar(conn, ready_sql) - read_only_from
        with topo.admin() as admin:
            admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
            admin.execute("SELECT pg_reload_conf()")
        wait_until(lambda: scalar(conn, ready_sql) >= docs, timeout=240, interval=0.2, what="the drain")
        assert all(p.poll() is None for p in procs), [topo.log_tail(f"worker-{h}-restart") for h in topo.worker_hosts]
    finally:
        with topo.admin() as admin:
            admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
            admin.execute("SELECT pg_reload_conf()")
        topo.stop_workers(procs)
        topo.provider_faults(latency=0.0)
    assert counts(conn) == {"ready": docs}
    assert_vectors(conn)
    billed = billed_for(topo, "restart")
    FIGURES["db_restart_read_only"] = {
        "completed_while_read_only": during,
        "extra_bill_inputs": sum(billed.values()) - docs,
        "load": load(),
    }
    assert during == 0, "nothing completes while the database refuses writes"
    assert scalar(conn, "SELECT count(*) FROM app.embedding_jobs WHERE attempts > 1") == 0, "nothing charged"
    conn.close()


def test_latency_and_loss_on_every_worker_link_to_the_db_host(topo):
    """100 ms RTT and 1% loss between every worker host and the db host (tc netem where the kernel
    has it, else the userspace relay of linkrelay.py on each worker host): the corpus completes,
    nothing dead-lettered, one provider vector per chunk, every input billed once per drain (beyond
    that at most what the ledger counts as resent). Throughput against the same drain on clean
    links (THROUGHPUT, the long profile): LATENCY_ROUNDS interleaved rounds (clean, then slowed), the
    ratio of the summed windows; with the relay, a control drain through relays that neither delay nor
    lose (their own cost)."""
    jobs = LATENCY_JOBS
    new_database(topo, "lat_t", jobs).close()
    opts = {"PIPELINE_BATCH_INPUTS": str(LATENCY_BATCH)}
    args = ("--concurrency", "4")
    rounds: list[dict] = []
    drained: list[psycopg.Connection] = []
    rtt, mechanism, relayed = None, None, []
    for r in range(LATENCY_ROUNDS):
        r_clean = None
        if THROUGHPUT:
            clean = copy_database(topo, "lat_t", f"lat{r}_clean")
            drained.append(clean)
            r_clean = drain(topo, clean, f"lat{r}_clean", topo.worker_hosts, args=args, **opts)
            assert r_clean["counts"] == {"ready": jobs}, r_clean
        slow = copy_database(topo, "lat_t", f"lat{r}_slow")
        drained.append(slow)
        with topo.slow_links(topo.worker_hosts, delay=LINK_DELAY_S, loss=LINK_LOSS, rto=LINK_RTO_S) as link:
            if link["relays"] and rtt is None:
                rtt = round_trip_s(topo, link["relays"][topo.worker_hosts[0]], f"lat{r}_slow")
            r_slow = drain(topo, slow, f"lat{r}_slow", topo.worker_hosts, timeout=400, args=args, **opts)
        mechanism = link["mechanism"]
        relayed.append(link["relay_stats"])
        rounds.append({"clean": r_clean, "slow": r_slow})
        assert r_slow["counts"] == {"ready": jobs}, rounds
        assert_vectors(slow)
    overhead = None
    if mechanism == "relay" and THROUGHPUT:  # the control: the same relays forwarding at once, nothing lost
        bare = copy_database(topo, "lat_t", "lat_relay0")
        drained.append(bare)
        with topo.slow_links(topo.worker_hosts, delay=0.0, loss=0.0, rto=0.0):
            overhead = drain(topo, bare, "lat_relay0", topo.worker_hosts, args=args, **opts)
        assert overhead["counts"] == {"ready": jobs}, overhead
    clean_s = sum(r["clean"]["window_s"] for r in rounds if r["clean"]) or None
    slow_s = sum(r["slow"]["window_s"] for r in rounds)
    FIGURES["latency_loss"] = {
        "mechanism": mechanism,
        "jobs": jobs,
        "rounds": rounds,
        "select_1_through_relay_s": rtt and round(rtt, 3),
        "relay_stats": relayed,
        "throughput_vs_clean": clean_s and round(clean_s / slow_s, 2),
        "clean_jobs_per_s": clean_s and round(len(rounds) * jobs / clean_s, 1),
        "slow_jobs_per_s": round(len(rounds) * jobs / slow_s, 1),
        "relay_without_delay": overhead
        and clean_s
        and {"jobs_per_s": overhead["jobs_per_s"], "vs_clean": round(clean_s / len(rounds) / overhead["window_s"], 2)},
        "load": load(),
    }
    print(f"\nlatency and loss applied with {mechanism}:", json.dumps(FIGURES["latency_loss"]), file=sys.stderr)
    if mechanism == "relay":
        assert rtt is not None and rtt >= 2 * LINK_DELAY_S, "a round trip through the relay crosses both delays"
        assert all(s and s["chunks_up"] > 0 and s["chunks_down"] > 0 for run in relayed for s in run.values()), relayed
    billed = billed_for(topo, "lat_t")
    resent = sum(scalar(c, "SELECT coalesce(sum(sends - 1), 0) FROM app.input_sends") for c in drained)
    extra = sum(billed.values()) - len(drained) * jobs
    FIGURES["latency_loss"] |= {"extra_bill_inputs": extra, "ledger_resent": resent}
    assert len(billed) == jobs and 0 <= extra <= resent, FIGURES["latency_loss"]
    for c in drained:
        c.close()
