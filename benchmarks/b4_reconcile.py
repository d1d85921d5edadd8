"""B4: set-based reconciliation over 1,000,000 chunks.

Loads a consistent synthetic state straight into the schema with INSERT ...
SELECT generate_series (every current chunk has a ready job and an 8-dim vector;
one active model; no HNSW index, no sources), then times
`reconcile(conn, options, rescan=False)` on it. Then removes the jobs (and
vectors) of 1% of the chunks and adds orphan jobs for 1% more content (ready,
with vectors, but carried by no chunk) and times the repair, checking that it
enqueued exactly the missing jobs and superseded exactly the orphans.

    python benchmarks/b4_reconcile.py [--chunks 1000000] [--chunks-per-doc 4]
"""

from __future__ import annotations

import argparse

from _common import Timer, emit, fresh_database, peak_rss_mb

from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.app.reconcile import reconcile
from pipeline_assets.app.runtime import IngestOptions, chunker_for
from pipeline_assets.settings import Settings
from pipeline_assets.store import db

MODEL = "bench/reconcile@8"
VECTOR = "[1,0,0,0,0,0,0,0]"


def load(conn, chunks: int, per_doc: int) -> dict:
    docs = -(-chunks // per_doc)
    with Timer() as t:
        conn.execute(
            "INSERT INTO app.models (model_id, provider, name, dimension, max_input_tokens)"
            " VALUES (%s, 'bench', 'reconcile', 8, 8191)",
            (MODEL,),
        )
        source = conn.execute("INSERT INTO app.sources (root) VALUES ('/bench/b4') RETURNING source_id").fetchone()[0]
        conn.execute(
            "INSERT INTO app.documents (source_id, document_id, source_uri, status, chunk_count)"
            " SELECT %s, 'doc/' || g, 'file:///bench/b4/doc/' || g, 'current', %s FROM generate_series(1, %s) g",
            (source, per_doc, docs),
        )
        conn.execute(
            "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end)"
            " SELECT d.doc_pk, k, sha256(int8send(d.doc_pk * 1000 + k)), 'chunk ' || d.doc_pk || '/' || k, 3, 0, 10"
            " FROM app.documents d CROSS JOIN generate_series(0, %s - 1) k"
            " WHERE (d.doc_pk - 1) * %s + k < %s",
            (per_doc, per_doc, chunks),
        )
        with conn.transaction():  # a job and its key commit together (deferred foreign keys, sql/009)
            conn.execute(
                "INSERT INTO app.embedding_jobs (chunk_checksum, model_id, status, attempts)"
                " SELECT chunk_checksum, %s, 'ready', 1 FROM app.chunks",
                (MODEL,),
            )
            conn.execute(
                "INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)"
                " SELECT chunk_checksum, model_id, job_id FROM app.embedding_jobs"
            )
        conn.execute(
            "INSERT INTO app.embeddings (chunk_checksum, model_id, embedding)"
            " SELECT chunk_checksum, %s, %s::vector FROM app.chunks",
            (MODEL, VECTOR),
        )
    with Timer() as v:
        conn.execute("VACUUM ANALYZE")  # as autovacuum would have, so plans see real row counts
    counts = conn.execute(
        "SELECT (SELECT count(*) FROM app.documents), (SELECT count(*) FROM app.chunks),"
        " (SELECT count(*) FROM app.embedding_jobs), (SELECT count(*) FROM app.embeddings)"
    ).fetchone()
    return {
        "documents": counts[0],
        "chunks": counts[1],
        "jobs": counts[2],
        "vectors": counts[3],
        "insert_seconds": round(t.seconds, 1),
        "vacuum_analyze_seconds": round(v.seconds, 1),
    }


def damage(conn, chunks: int) -> dict:
    """Drop the job and vector of 1% of chunks; add 1% orphan ready jobs with vectors."""
    n = chunks // 100
    with conn.transaction():
        conn.execute(
            "CREATE TEMP TABLE lost AS SELECT chunk_checksum FROM app.chunks ORDER BY chunk_checksum LIMIT %s", (n,)
        )
        conn.execute("DELETE FROM app.embedding_jobs j USING lost l WHERE j.chunk_checksum = l.chunk_checksum")
        conn.execute("DELETE FROM app.job_keys k USING lost l WHERE k.chunk_checksum = l.chunk_checksum")
        conn.execute("DELETE FROM app.embeddings e USING lost l WHERE e.chunk_checksum = l.chunk_checksum")
        conn.execute(
            "CREATE TEMP TABLE orphan AS SELECT sha256(('orphan' || g)::bytea) AS chunk_checksum"
            " FROM generate_series(1, %s) g",
            (n,),
        )
        conn.execute(
            "INSERT INTO app.embedding_jobs (chunk_checksum, model_id, status, attempts)"
            " SELECT chunk_checksum, %s, 'ready', 1 FROM orphan",
            (MODEL,),
        )
        conn.execute(
            "INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)"
            " SELECT j.chunk_checksum, j.model_id, j.job_id FROM app.embedding_jobs j"
            " JOIN orphan o USING (chunk_checksum)"
        )
        conn.execute(
            "INSERT INTO app.embeddings (chunk_checksum, model_id, embedding)"
            " SELECT chunk_checksum, %s, %s::vector FROM orphan",
            (MODEL, VECTOR),
        )
    conn.execute("ANALYZE app.embedding_jobs")
    conn.execute("ANALYZE app.embeddings")
    return {"chunks_without_job": n, "orphan_jobs": n}


def check(conn) -> dict:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM app.chunks c WHERE NOT EXISTS (SELECT 1 FROM app.embedding_jobs j"
        "        WHERE j.chunk_checksum = c.chunk_checksum AND j.model_id = %(m)s)),"
        "       (SELECT count(*) FROM app.embedding_jobs j JOIN orphan o USING (chunk_checksum)"
        "        WHERE j.status <> 'superseded'),"
        "       (SELECT count(*) FROM app.embeddings e JOIN orphan o USING (chunk_checksum)),"
        "       (SELECT count(*) FROM app.embedding_jobs j JOIN lost l USING (chunk_checksum)"
        "        WHERE j.status = 'pending')",
        {"m": MODEL},
    ).fetchone()
    return {
        "chunks_still_without_job": row[0],
        "orphans_not_superseded": row[1],
        "orphan_vectors_left": row[2],
        "lost_chunks_now_pending": row[3],
    }


def backend_peak_rss_mb(conn) -> float | None:
    """VmHWM of this connection's server process, when the server runs on this machine."""
    try:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=1_000_000)
    p.add_argument("--chunks-per-doc", type=int, default=4)
    args = p.parse_args()
    options = IngestOptions(chunker=chunker_for(Settings.from_env()), config=IngestConfig(max_bytes=1 << 20))
    out: dict = {"benchmark": "b4_reconcile"}
    with fresh_database("b4") as url:
        with db.connect(url) as conn:
            out["load"] = load(conn, args.chunks, args.chunks_per_doc)
        conn = db.connect(url)  # a new backend, so its peak RSS is reconcile's alone
        rss_before = peak_rss_mb()
        with Timer() as t:
            report = reconcile(conn, options, rescan=False)
        out["consistent"] = {"seconds": round(t.seconds, 2), "report": report.as_dict()}
        out["damage"] = damage(conn, args.chunks)
        with Timer() as t:
            report = reconcile(conn, options, rescan=False)
        out["repair"] = {"seconds": round(t.seconds, 2), "report": report.as_dict(), "after": check(conn)}
        out["server_backend_peak_rss_mb"] = backend_peak_rss_mb(conn)  # includes shared buffers touched
        conn.close()
    out["peak_rss_mb"] = peak_rss_mb()
    out["peak_rss_mb_before_reconcile"] = rss_before
    out["repaired_exactly"] = (
        out["repair"]["report"]["enqueued"] == out["damage"]["chunks_without_job"]
        and out["repair"]["report"]["superseded"] == out["damage"]["orphan_jobs"]
        and not any(
            out["repair"]["after"][k]
            for k in ("chunks_still_without_job", "orphans_not_superseded", "orphan_vectors_left")
        )
        and out["repair"]["after"]["lost_chunks_now_pending"] == out["damage"]["chunks_without_job"]
    )
    out["targets"] = {
        "consistent_seconds<=20": out["consistent"]["seconds"] <= 20,
        "repair_seconds<=20": out["repair"]["seconds"] <= 20,
    }
    emit(out)


if __name__ == "__main__":
    main()
