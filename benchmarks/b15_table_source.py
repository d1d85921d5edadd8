"""B15: a 1M-row PostgreSQL table as a source (`table:src.docs?id=id&text=body&updated=updated_at`).

``unchanged``: the unchanged check (``scan_table``, the checksum way; the watermark way too) against
``SELECT count(*), sum(hashtext(body))`` of the same table, interleaved, median of 3; ``ratio`` =
baseline / check (target >= 0.3). ``updated``: 1,000 rows updated, then the seconds until their new
chunks' jobs are in the job table, through the change log, the watermark and the checksums. The
stored row tokens are seeded as a full ingest leaves them; the rows to update are ingested for real
first. Prints one JSON object; each key: benchmarks/README.md, B15.

    python benchmarks/b15_table_source.py [--rows 1000000] [--updates 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics

import psycopg
from _common import Timer, emit, fresh_database, settle

from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.app.runtime import IngestOptions
from pipeline_assets.app.table_ingest import CHANGE_LOG, FULL, WATERMARK, scan_table
from pipeline_assets.app.table_source import TableSource
from pipeline_assets.content.chunking import Chunker
from pipeline_assets.providers.local import LocalHashingProvider
from pipeline_assets.registry import models
from pipeline_assets.settings import Settings
from pipeline_assets.store import change_log, db

SOURCE = "table:src.docs?id=id&text=body&updated=updated_at"
REPEATS = 3


def load(conn: psycopg.Connection, rows: int) -> None:
    conn.execute("CREATE SCHEMA src")
    conn.execute("CREATE TABLE src.docs (id bigint PRIMARY KEY, body text, updated_at timestamptz NOT NULL)")
    conn.execute(
        "INSERT INTO src.docs (id, updated_at, body) SELECT g, now() - interval '1 day' + g * interval '1 ms',"
        " 'Row ' || g || ': ' || md5(g::text) || ' '"
        " || md5((g * 7)::text) || ' ' || md5((g * 13)::text) || ' and some words of prose.'"
        " FROM generate_series(1, %s) g",
        (rows,),
    )
    conn.execute("CREATE INDEX ON src.docs (updated_at)")
    conn.execute("VACUUM ANALYZE src.docs")


def seed_tokens(conn: psycopg.Connection, uri: str) -> None:
    """app.table_rows as a full ingest leaves it (the source's own tokens) and the watermark."""
    conn.execute(
        "INSERT INTO app.table_rows (source, row_id, id_hash, version)"
        " SELECT %(s)s, id::text, h, hashtextextended(coalesce(body, ''), h)"
        " FROM (SELECT id, body, hashtextextended(id::text, 0) AS h FROM src.docs) t",
        {"s": uri},
    )
    conn.execute(
        "INSERT INTO app.table_marks (source, watermark) SELECT %(s)s, max(updated_at)::text FROM src.docs", {"s": uri}
    )
    conn.execute("VACUUM ANALYZE app.table_rows")


def enqueued(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0]


def update(conn: psycopg.Connection, first: int, n: int, rows: int, tag: str) -> None:
    step = max(rows // n, 1)
    conn.execute(
        "UPDATE src.docs SET body = body || %s, updated_at = now()"
        " WHERE id IN (SELECT g FROM generate_series(%s, %s, %s) g LIMIT %s)",
        (f" ({tag})", first, rows, step, n),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--updates", type=int, default=1_000)
    args = ap.parse_args()
    options = IngestOptions(chunker=Chunker(max_tokens=256, overlap=16), config=IngestConfig(max_bytes=1 << 20))
    out: dict = {"rows": args.rows, "updates": args.updates, "load": os.getloadavg()[0]}
    with fresh_database("table") as url, db.session(url) as conn:
        table = TableSource(SOURCE, Settings.from_env({"PIPELINE_DATABASE_URL": url}).source_config())
        spec = table.spec
        load(conn, args.rows)
        seed_tokens(conn, spec.uri)
        models.ensure_model(conn, LocalHashingProvider().spec)

        baseline, check, mark_check = [], [], []
        for _ in range(REPEATS):
            settle(url)
            with Timer() as t:
                conn.execute("SELECT count(*), sum(hashtext(body)) FROM src.docs").fetchone()
            baseline.append(t.seconds)
            with Timer() as t:
                report, scan = scan_table(conn, table, options, way=FULL)
            assert scan.rows_read == 0 and scan.buckets_listed == 0, scan
            check.append(t.seconds)
            with Timer() as t:
                report, scan = scan_table(conn, table, options, way=WATERMARK)
            assert scan.rows_read == 0, scan
            mark_check.append(t.seconds)
        b, c, m = statistics.median(baseline), statistics.median(check), statistics.median(mark_check)
        out["unchanged"] = {
            "baseline_count_sum_hashtext_s": round(b, 3),
            "full_check_s": round(c, 3),
            "watermark_check_s": round(m, 3),
            "ratio": round(b / c, 2),
            "ratio_watermark": round(b / m, 2),
        }

        # The rows to update ingested for real first (so the timed scans replace their chunks).
        step = max(args.rows // args.updates, 1)
        targets = [str(i) for i in range(1, args.rows + 1, step)][: args.updates]
        conn.execute(
            "UPDATE app.table_rows SET version = 0 WHERE source = %s AND row_id = ANY(%s)", (spec.uri, targets)
        )
        scan_table(conn, table, options, way=FULL)
        updated = {}
        change_log.install(table.table)
        for way, tag in ((CHANGE_LOG, "c"), (WATERMARK, "w"), (FULL, "f")):
            update(conn, 1, args.updates, args.rows, tag)
            before = enqueued(conn)
            settle(url)
            with Timer() as t:
                report, scan = scan_table(conn, table, options, way=way)
            if way == CHANGE_LOG:
                change_log.uninstall(table.table)
            updated[way] = {
                "seconds": round(t.seconds, 3),
                "changed": report.changed,
                "jobs_enqueued": enqueued(conn) - before,
                "rows_listed": scan.rows_listed,
                "rows_read": scan.rows_read,
            }
        out["updated"] = updated
        table.close()
    out["targets"] = {"unchanged_ratio_ge_0.3": out["unchanged"]["ratio"] >= 0.3}
    out["load_after"] = os.getloadavg()[0]
    emit(out)


if __name__ == "__main__":
    main()
