"""The job queue's statements stay index-backed as the job table grows.

A few hundred thousand jobs are loaded in the physical order a long-lived queue has them (the
superseded history first, the live queue at the end of the heap), then VACUUM ANALYZE, and every named
statement of ``sql/queries/jobs.sql`` is planned with ``EXPLAIN (FORMAT JSON)`` and realistic
parameters (a claim of 64, a completion of one lease's 64 jobs, a live rescuer, an ingest batch).

* Per-item statements, and any statement in neither list: no sequential scan of
  ``app.embedding_jobs`` or ``app.job_keys`` anywhere in the plan; their cost follows the batch.
* Whole-set reconcile statements (``SET_BASED``, timed by B4) read the job table once by nature but stay
  linear: no sequential scan of a job table re-run per outer row (a nested loop's inner side, a
  correlated subplan).
"""

from __future__ import annotations

import contextlib
import re
import time

import numpy as np
import psycopg
import pytest
from psycopg import sql

from pipeline_assets.jobqueue import ledger, transitions
from pipeline_assets.store import db, queries

MODEL = "test/plans@8"
DOCUMENTS, CHUNKS_PER_DOCUMENT = 45_000, 4  # 180,000 current chunks
HISTORY = 90_000  # superseded jobs whose content is gone
JOB_TABLES = {"embedding_jobs", "job_keys"}
BATCH = 64

# Whole-set reconcile statements: one pass over the table is their job.
SET_BASED = {"supersede_unwanted", "revive_wanted", "repair_missing_vectors", "drop_orphan_keys", "enqueue_missing"}
# Statements that never touch a job table.
NO_JOB_TABLE = {
    "release_probe",
    "provider_failure",
    "provider_healthy",
    "enqueue_scope_missing",
    "provider_pause",
    "provider_unusable",
    "provider_unusable_count",
    "provider_usable",
}
# The statements whose plans are checked; each must exist (a rename shows here, not as a silent skip).
REQUIRED = {
    "claim_all",
    "claim_docs",
    "complete",
    "extend_lease",
    "rescue_expired",
    "give_back",
    "fail_retryable",
    "outstanding",
    "supersede_unwanted_among",
    "revive_wanted_among",
    "enqueue_docs",
}

# The live queue, by share of the 180,000 current chunks (the rest is ready).
LIVE = [("failed", 2), ("retry", 2), ("processing", 1), ("pending", 5)]


@pytest.fixture(scope="module")
def big_queue(database_url):
    conn = db.connect(database_url)
    db.migrate(conn)
    started = time.monotonic()
    # A bulk load into a throwaway database: no per-row foreign-key triggers (some
    # 700,000 checks would be most of the load). Needs a superuser (the embedded
    # server's role); on a server where the role is not one, the load is slower.
    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        conn.execute("SET session_replication_role = replica")
    conn.execute(
        "INSERT INTO app.models (model_id, provider, name, dimension) VALUES (%s, 'test', 'plans', 8)", (MODEL,)
    )
    source = conn.execute("INSERT INTO app.sources (root) VALUES ('/plans') RETURNING source_id").fetchone()[0]
    conn.execute(
        """INSERT INTO app.documents (source_id, document_id, source_uri, status, chunk_count)
                    SELECT %s, 'd/' || g, 'd/' || g, 'current', %s FROM generate_series(1, %s) g""",
        (source, CHUNKS_PER_DOCUMENT, DOCUMENTS),
    )
    conn.execute(
        """INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count,
                                            char_start, char_end)
                    SELECT d.doc_pk, k, sha256(int8send(d.doc_pk * 10 + k)), 'c', 1, 0, 1
                    FROM app.documents d CROSS JOIN generate_series(0, %s - 1) k""",
        (CHUNKS_PER_DOCUMENT,),
    )
    # Status by chunk: every 100 chunks, the first 90 ready, then the live queue's shares.
    cases, low = [], 90
    for status, share in LIVE:
        cases.append(sql.SQL("WHEN mod(n, 100) < {} THEN {}").format(sql.Literal(low + share), sql.Literal(status)))
        low += share
    status_of = sql.SQL("CASE WHEN mod(n, 100) < 90 THEN 'ready' {} END").format(sql.SQL(" ").join(cases))
    with conn.transaction():  # a job and its key commit together (deferred foreign keys)
        conn.execute(
            """INSERT INTO app.embedding_jobs (chunk_checksum, model_id, status, attempts, updated_at)
                        SELECT sha256(('gone' || g)::bytea), %s, 'superseded', 1,
                               now() - random() * interval '30 days'
                        FROM generate_series(1, %s) g""",
            (MODEL, HISTORY),
        )
        conn.execute(
            sql.SQL("""
            INSERT INTO app.embedding_jobs (chunk_checksum, model_id, status, attempts, available_at,
                                            lease_owner, lease_expires_at, updated_at)
            SELECT checksum, %(m)s, status, 1, now() + (random() * 600 - 300) * interval '1 second',
                   CASE WHEN status = 'processing'
                        THEN 'w' || mod(n / 100, 4) || '/00000000-0000-0000-0000-00000000000' || mod(n / 100, 4)
                             || '/' || n END,
                   CASE WHEN status = 'processing' THEN now() + interval '60 seconds' END,
                   now() - random() * interval '2 days'
            FROM (SELECT sha256(int8send(d.doc_pk * 10 + k)) AS checksum,
                         (d.doc_pk - 1) * {per} + k AS n
                  FROM app.documents d CROSS JOIN generate_series(0, {per} - 1) k) c,
                 LATERAL (SELECT {status} AS status) s
            ORDER BY array_position(ARRAY['ready', 'failed', 'retry', 'processing', 'pending'], status), n
            """).format(per=sql.Literal(CHUNKS_PER_DOCUMENT), status=status_of),
            {"m": MODEL},
        )
        conn.execute("""INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)
                        SELECT chunk_checksum, model_id, job_id FROM app.embedding_jobs""")
    conn.execute("""INSERT INTO app.embeddings (chunk_checksum, model_id, embedding)
                    SELECT chunk_checksum, model_id, '[1,0,0,0,0,0,0,0]' FROM app.embedding_jobs
                    WHERE status = 'ready'""")
    for i in range(4):
        conn.execute(
            """INSERT INTO app.workers (owner_prefix, worker_id, model_id, host, pid, alive_since,
                                                 alive_until)
                        VALUES (%s, %s, %s, 'h', 1, now() - interval '1 minute', now() + interval '5 seconds')""",
            (f"w{i}/00000000-0000-0000-0000-00000000000{i}/", f"w{i}", MODEL),
        )
    conn.execute("INSERT INTO app.provider_state (model_id) VALUES (%s)", (MODEL,))
    conn.execute("RESET session_replication_role")
    loaded = time.monotonic() - started
    # As autovacuum would have (and B4 does). Not ANALYZE alone: with a stale visibility map (a bulk
    # enqueue before autovacuum) the planner may cost an EXISTS probe's sequential scan like the claim
    # index; the statements are shaped to stay index-only whatever the statistics (decision 0008).
    conn.execute("VACUUM ANALYZE")
    print(
        f"\nloaded {conn.execute('SELECT count(*) FROM app.embedding_jobs').fetchone()[0]} jobs in {loaded:.1f} s, "
        f"vacuum analyze {time.monotonic() - started - loaded:.1f} s"
    )
    yield conn
    conn.close()


def _params(conn) -> dict:
    """One set of realistic parameters, a superset of every statement's."""
    owner = conn.execute(
        "SELECT lease_owner FROM app.embedding_jobs WHERE status = 'processing' ORDER BY job_id LIMIT 1"
    ).fetchone()[0]
    held = [
        r[0]
        for r in conn.execute(
            "SELECT job_id FROM app.embedding_jobs WHERE lease_owner = %s ORDER BY job_id LIMIT %s", (owner, BATCH)
        )
    ]
    failed = [
        r[0]
        for r in conn.execute("SELECT job_id FROM app.embedding_jobs WHERE status = 'failed' ORDER BY job_id LIMIT 10")
    ]
    docs = [r[0] for r in conn.execute("SELECT doc_pk FROM app.documents ORDER BY doc_pk DESC LIMIT 200")]
    checksums = [
        bytes(r[0]) for r in conn.execute("SELECT chunk_checksum FROM app.chunks WHERE doc_pk = ANY(%s)", (docs,))
    ]
    vector = np.zeros(8, dtype=np.float32)
    vector[0] = 1.0
    rescuer = "w0/00000000-0000-0000-0000-000000000000/"
    return {
        "model": MODEL,
        "owner": owner,
        "limit": BATCH,
        "lease": 60.0,
        "ids": held,
        "vecs": [vector] * len(held),
        "delays": [1.0] * len(held),
        "delay": 0.0,
        "cls": "timeout",
        "msg": "timed out",
        "throttled": False,
        "job_ids": held,
        "vectors": [vector] * len(held),
        "error_class": "timeout",
        "message": "timed out",
        "faulted": False,
        "rescuer": rescuer,
        "base": 1.0,
        "cap": 60.0,
        "free_faults": 6,
        "checksums": checksums,
        "models": [MODEL] * len(checksums),
        "all": False,
        "max_attempts": 5,
        "docs": docs,
        "trip": True,
        "floor": 1.0,
        "threshold": 5,
        "probe_cap": 5.0,
        "failed_ids": failed,
        "call": 1,
        "tokens": len(held),
        "latency_ms": 5,
        "outcome": "ok",
        "http_status": 200,
        "billed": "yes",
    }


def _statements() -> dict[str, sql.Composable]:
    jobs = queries.load("jobs")
    out: dict[str, sql.Composable] = {}
    for name in jobs.names():
        if name in NO_JOB_TABLE:
            continue
        if name in ("enqueue", "claim"):  # templates with their scopes (and the claim's batch size)
            for scope in [n for n in jobs.names() if n.startswith(f"{name}_scope_")]:
                out[scope.replace("_scope", "")] = sql.SQL(getattr(jobs, name)).format(
                    scope=sql.SQL(getattr(jobs, scope)), **({"limit": sql.Literal(BATCH)} if name == "claim" else {})
                )
            continue
        if "_scope_" in name:
            continue
        out[name] = sql.SQL(getattr(jobs, name))
    return out


def _nodes(plan: dict, repeated: bool = False):
    """Every plan node, with whether it may run once per row of another: the inner
    side of a nested loop over more than one (estimated) outer row, or a correlated
    subplan."""
    yield plan, repeated
    children = plan.get("Plans", [])
    outer_rows = next((c.get("Plan Rows", 1) for c in children if c.get("Parent Relationship") == "Outer"), 1)
    for child in children:
        inner = (
            plan["Node Type"] == "Nested Loop" and child.get("Parent Relationship") == "Inner" and outer_rows > 1
        ) or child.get("Parent Relationship") == "SubPlan"
        yield from _nodes(child, repeated or inner)


def _plan(conn, statement: sql.Composable, params: dict) -> dict:
    return conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) ") + statement, params).fetchone()[0][0]["Plan"]


def test_queue_statements_do_not_scan_the_job_table(big_queue):
    conn = big_queue
    assert conn.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0] >= 250_000
    params = _params(conn)
    statements = _statements()
    assert set(statements) >= REQUIRED, f"statements missing from jobs.sql: {REQUIRED - set(statements)}"
    scanned, quadratic, planned = {}, {}, {}
    for name, statement in statements.items():
        run = dict(params, ids=params["failed_ids"]) if name == "requeue_failed" else params
        plan = _plan(conn, statement, run)
        planned[name] = plan["Total Cost"]
        seq = [
            (n["Relation Name"], n.get("Plan Rows"), again)
            for n, again in _nodes(plan)
            if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in JOB_TABLES
        ]
        if name in SET_BASED:
            if any(again for *_, again in seq):
                quadratic[name] = seq
        elif seq:
            scanned[name] = seq
    print("planned:", ", ".join(f"{n} {c:.0f}" for n, c in sorted(planned.items())))
    assert not scanned, f"per-item statements that scan a job table sequentially: {scanned}"
    assert not quadratic, f"set-based statements that re-scan a job table per row: {quadratic}"
    # The checks can fail: a statement with no usable index is seen as a scan.
    naive = _plan(conn, sql.SQL("SELECT job_id FROM app.embedding_jobs WHERE error_message = %(msg)s"), params)
    assert any(n["Node Type"] == "Seq Scan" for n, _ in _nodes(naive))


def test_claim_and_complete_cost_follows_the_batch_not_the_table(big_queue):
    """The plans above, executed: a claim of 64 and the completion of those 64
    touch about 20 buffers per job, not the table's thousands of pages."""
    conn = big_queue
    jobs = queries.load("jobs")
    pages = conn.execute("SELECT relpages FROM pg_class WHERE oid = 'app.embedding_jobs'::regclass").fetchone()[0]
    params = _params(conn)
    params["owner"] = "w1/00000000-0000-0000-0000-000000000001/999999"
    with conn.transaction(force_rollback=True):
        claim = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ")
            + sql.SQL(jobs.claim).format(scope=sql.SQL(jobs.claim_scope_all), limit=sql.Literal(BATCH)),
            params,
        ).fetchone()[0][0]
        claimed = [
            r[0]
            for r in conn.execute("SELECT job_id FROM app.embedding_jobs WHERE lease_owner = %s", (params["owner"],))
        ]
        assert len(claimed) == BATCH
        vector = params["vecs"][0]
        checksums = [
            bytes(r[0])
            for r in conn.execute("SELECT chunk_checksum FROM app.embedding_jobs WHERE job_id = ANY(%s)", (claimed,))
        ]
        call = ledger.record_send(conn, model_id=MODEL, worker_id="w1", checksums=checksums, tokens=BATCH)
        # The successful answer's one statement: the call settled, the jobs completed, their vectors stored.
        complete = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + sql.SQL(jobs.complete),
            dict(params, job_ids=claimed, vectors=[vector] * len(claimed), call=call, tokens=BATCH),
        ).fetchone()[0][0]
        assert (
            conn.execute(
                "SELECT count(*) FROM app.embedding_jobs WHERE job_id = ANY(%s) AND status = 'ready'", (claimed,)
            ).fetchone()[0]
            == BATCH
        )
        assert conn.execute(
            "SELECT outcome, billed, tokens, answered_at IS NOT NULL FROM app.provider_calls WHERE call_id = %s",
            (call,),
        ).fetchone() == ("ok", "yes", BATCH, True)
        # Every job won: the supersede of the refused ones (lost) probed no row of the job table.
        lost = [
            n
            for n, _ in _nodes(complete["Plan"])
            if n.get("Relation Name") == "embedding_jobs"
            and n["Node Type"] == "ModifyTable"
            and n.get("Operation") == "Update"
            and n.get("Actual Rows") == 0
        ]
        assert lost and all(_probed(n) == 0 for n in lost), lost

    def buffers(p: dict) -> int:
        top = p["Plan"]
        return top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)

    print(
        f"\njob table {pages} pages; claim of {BATCH}: {buffers(claim)} buffers, {claim['Execution Time']:.1f} ms;"
        f" complete: {buffers(complete)} buffers, {complete['Execution Time']:.1f} ms"
    )
    # About 20 buffers per job (index descents, the rows, their index entries); a
    # sequential scan would read every page of the table.
    for name, p in (("claim", claim), ("complete", complete)):
        assert buffers(p) < min(pages / 2, 40 * BATCH), (name, buffers(p), pages)


def test_the_claim_is_planned_once_per_connection_and_its_plan_follows_the_batch(big_queue):
    """psycopg prepares a statement a connection ran 5 times; the server then keeps
    one generic plan for the claim when that plan costs no more than a custom one,
    instead of planning every claim afresh (about 1 ms each, ~10 us per job). The
    claim's batch size is a literal of the statement and the picked ids reach its
    UPDATE as an array, so the generic plan is the custom one: index probes only,
    for either scope. (With the LIMIT a parameter, the generic plan costed the
    claim as a tenth of the queue and joined it to a sequential scan.)"""
    conn = big_queue
    for scoped in (False, True):
        numbered = _numbered(transitions.claim_statement(scoped, BATCH).decode())
        plan = conn.execute(sql.SQL("EXPLAIN (GENERIC_PLAN, FORMAT JSON) ") + sql.SQL(numbered)).fetchone()[0][0]
        seq = [
            n["Relation Name"]
            for n, _ in _nodes(plan["Plan"])
            if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in JOB_TABLES
        ]
        assert not seq, (scoped, seq)
    with conn.transaction(force_rollback=True):
        # 5 runs before psycopg prepares it, 5 custom plans before the server may go generic
        for i in range(13):
            assert (
                len(transitions.claim(conn, model_id=MODEL, owner=f"generic/{i}", limit=BATCH, lease_seconds=60))
                == BATCH
            )
        generic, custom = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE '%%SKIP LOCKED%%'"
        ).fetchone()
    assert (generic, custom) == (3, 5)


def _probed(plan: dict) -> int:
    """Rows the scans under a plan node read (actual rows times loops)."""
    return sum(
        int(n.get("Actual Rows", 0) * n.get("Actual Loops", 1))
        for n, _ in _nodes(plan)
        if "Scan" in n["Node Type"] and n.get("Relation Name") == "embedding_jobs"
    )


def _numbered(text: str) -> str:
    """A statement with its named parameters as $1, $2, ... (in order of first
    appearance), as the server sees a prepared statement."""
    names: list[str] = []

    def position(match: re.Match) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", position, text)
