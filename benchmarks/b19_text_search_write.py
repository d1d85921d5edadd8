"""B19: what the chunks' text-search vectors cost the server, by how they are written.

The chunk rows of N documents (b3's corpus, as ingest writes them) go into a scratch copy of app.chunks
(its indexes; autovacuum off, so each step is timed on its own) in each of the ``--ways``, alternating
per round: `fill` (COPY with the vector NULL, an UPDATE per 2,000 unfilled chunks, VACUUM), `trigger`,
`generated`, `alone` (to_tsvector only, nothing written), `gin_after` and `nolock`. Each step reports
its backend's CPU-seconds (the server on this machine), wall seconds and WAL bytes; medians of the
rounds. Each way: benchmarks/README.md, B19.

    python benchmarks/b19_text_search_write.py [--docs 10000] [--rounds 3] [--ways fill,gin_after,nolock]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import psycopg
from _common import emit, fresh_database, settle
from b19_end_to_end import corpus_slices

from pipeline_assets.content.sandbox import usable_cores
from pipeline_assets.store.documents import CHUNK_COPY_TYPES

FILL_BATCH_CHUNKS = 2_000
TICKS = os.sysconf("SC_CLK_TCK")

# app.chunks as sql/042 left it: a plain vector column, its GIN index, the partial index of the unfilled.
SCRATCH = """
DROP TABLE IF EXISTS app.chunks_bench;
CREATE TABLE app.chunks_bench (
    doc_pk bigint NOT NULL, chunk_index int NOT NULL, chunk_checksum bytea NOT NULL, text text NOT NULL,
    token_count int NOT NULL, char_start int NOT NULL, char_end int NOT NULL, text_search tsvector,
    PRIMARY KEY (doc_pk, chunk_index)) WITH (autovacuum_enabled = false);
CREATE INDEX ON app.chunks_bench (chunk_checksum);
CREATE INDEX ON app.chunks_bench USING gin (text_search);
CREATE INDEX ON app.chunks_bench (doc_pk, chunk_index) WHERE text_search IS NULL;
"""
FILL = """
WITH pending AS (
    SELECT doc_pk, chunk_index FROM app.chunks_bench WHERE text_search IS NULL
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
UPDATE app.chunks_bench c SET text_search = to_tsvector('english'::regconfig, c.text)
FROM pending p WHERE c.doc_pk = p.doc_pk AND c.chunk_index = p.chunk_index
"""
GENERATED = """
ALTER TABLE app.chunks_bench DROP COLUMN text_search;
ALTER TABLE app.chunks_bench ADD COLUMN text_search tsvector
    GENERATED ALWAYS AS (to_tsvector('english'::regconfig, text)) STORED;
CREATE INDEX ON app.chunks_bench USING gin (text_search);
"""
TRIGGER = """
CREATE FUNCTION pg_temp.bench_tsv() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN NEW.text_search := to_tsvector('english'::regconfig, NEW.text); RETURN NEW; END $$;
CREATE TRIGGER bench_tsv BEFORE INSERT ON app.chunks_bench FOR EACH ROW EXECUTE FUNCTION pg_temp.bench_tsv();
"""


WAYS = ("fill", "trigger", "generated", "alone", "gin_after", "nolock")


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def step(conn: psycopg.Connection, pid: int, run) -> dict:
    lsn0 = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
    run()
    wall, cpu = time.perf_counter() - wall0, cpu_seconds(pid) - cpu0
    wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn0,)).fetchone()[0]
    return {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "wal_mb": round(float(wal) / 2**20, 1)}


def copy_rows(conn: psycopg.Connection, rows: list[tuple]) -> None:
    with (
        conn.transaction(),
        conn.cursor().copy(
            "COPY app.chunks_bench (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end)"
            " FROM STDIN WITH (FORMAT BINARY)"
        ) as copy,
    ):
        copy.set_types(CHUNK_COPY_TYPES)
        for row in rows:
            copy.write_row(row)


NOLOCK = FILL.replace("FOR UPDATE SKIP LOCKED", "")


def fill(conn: psycopg.Connection, statement: str = FILL) -> None:
    while True:
        with conn.transaction():
            done = conn.execute(statement, {"limit": FILL_BATCH_CHUNKS}).rowcount
        if done < FILL_BATCH_CHUNKS:
            return


def one(url: str, way: str, rows: list[tuple]) -> dict:
    settle(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SCRATCH)
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        r: dict = {}
        if way == "alone":
            r["tsvector"] = step(
                conn,
                pid,
                lambda: conn.execute(
                    "SELECT sum(length(to_tsvector('english'::regconfig, t))) FROM unnest(%s::text[]) t",
                    ([row[3] for row in rows],),
                ),
            )
        else:
            if way == "trigger":
                conn.execute(TRIGGER)
            if way == "generated":
                conn.execute(GENERATED)
            r["copy"] = step(conn, pid, lambda: copy_rows(conn, rows))
            if way == "gin_after":
                conn.execute("DROP INDEX app.chunks_bench_text_search_idx")
            if way in ("fill", "gin_after"):
                r["fill"] = step(conn, pid, lambda: fill(conn))
            if way == "nolock":
                r["fill"] = step(conn, pid, lambda: fill(conn, NOLOCK))
            if way == "gin_after":
                r["gin"] = step(
                    conn, pid, lambda: conn.execute("CREATE INDEX ON app.chunks_bench USING gin (text_search)")
                )
            r["vacuum"] = step(conn, pid, lambda: conn.execute("VACUUM (PARALLEL 0) app.chunks_bench"))
            unfilled = conn.execute("SELECT count(*) FROM app.chunks_bench WHERE text_search IS NULL").fetchone()[0]
            assert unfilled == 0, unfilled
        r["total_cpu_s"] = round(sum(s["cpu_s"] for s in r.values()), 3)
        conn.execute("DROP TABLE app.chunks_bench")
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ways", default="fill,trigger,generated,alone", help=f"comma-separated, of: {','.join(WAYS)}")
    a = p.parse_args()
    with multiprocessing.get_context("fork").Pool(usable_cores()) as pool:
        rows = [row for _, slice_rows in corpus_slices(pool, a.docs) for row in slice_rows]
    ways = a.ways.split(",")
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    load0 = os.getloadavg()
    with fresh_database("tsw") as url:
        for _ in range(a.rounds):
            for way in ways:
                runs[way].append(one(url, way, rows))
    med = {}
    for way, rs in runs.items():
        med[way] = {
            part: (
                round(statistics.median(r[part] for r in rs), 3)
                if part == "total_cpu_s"
                else {k: round(statistics.median(r[part][k] for r in rs), 3) for k in rs[0][part]}
            )
            for part in rs[0]
        }
    emit({"docs": a.docs, "chunks": len(rows), "rounds": a.rounds, "load": [load0, os.getloadavg()], **med})


if __name__ == "__main__":
    main()
