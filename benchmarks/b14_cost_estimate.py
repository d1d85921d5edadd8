"""B14: the cost estimate of the dry runs and the Dagster preflight, at 100k+ chunks.

Loads a synthetic corpus straight into a fresh database (N documents of 4 chunks, one chunk
in ten a copy of another document's, ~600 characters each), registers two models: A with
jobs for every content and half of them ready with a vector (1% dead-lettered), B new. Then
times, median of --repeat runs each, the estimate queries the commands use
(``app.estimate``): the whole corpus for A and B (`models add --dry-run`), one bucket and all
64 (the embeddings run's preflight), 10,000 documents (`rerun --stage embed --dry-run`'s
selection). The baseline is what the estimate replaces: reading the text of every input B
lacks into Python and counting its cl100k tokens (once).

    python benchmarks/b14_cost_estimate.py [--documents 50000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from _common import Timer, emit, fresh_database, settle

from pipeline_assets.app import estimate
from pipeline_assets.content.chunking import get_encoding
from pipeline_assets.jobqueue import transitions
from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import models
from pipeline_assets.store import db

CHUNKS_PER_DOCUMENT = 4
ROOT = "/bench/corpus"
BUCKETS = 64


def spec(name: str) -> ModelSpec:
    return ModelSpec(
        provider="openai",
        name=name,
        dimension=16,
        max_input_tokens=8191,
        max_batch_inputs=100,
        max_batch_tokens=300_000,
        options=(("dimensions", "16"),),
    )


def load(url: str, documents: int, a: ModelSpec, b: ModelSpec) -> dict:
    with db.connect(url) as conn, conn.transaction():
        conn.execute("INSERT INTO app.sources (root) VALUES (%s)", (ROOT,))
        conn.execute(
            """INSERT INTO app.documents (source_id, document_id, source_uri, status, chunk_count)
                        SELECT 1, 'doc-' || lpad(i::text, 7, '0') || '.md', 'file:///x', 'current', %s
                        FROM generate_series(1, %s) AS i""",
            (CHUNKS_PER_DOCUMENT, documents),
        )
        # One chunk in ten carries the text of another document's chunk (the same checksum).
        conn.execute(
            """INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count,
                                                char_start, char_end)
                        SELECT d.doc_pk, k, sha256(convert_to(t.body, 'UTF8')), t.body,
                               100 + (abs(hashtext(t.body)) %% 300), 0, length(t.body)
                        FROM app.documents d CROSS JOIN generate_series(0, %s - 1) AS k
                        CROSS JOIN LATERAL (SELECT CASE WHEN (d.doc_pk * 4 + k) %% 10 = 0
                                                        THEN 'shared ' || ((d.doc_pk + 1) %% 1000)
                                                        ELSE d.doc_pk || '/' || k END AS seed) s
                        CROSS JOIN LATERAL (SELECT string_agg(md5(s.seed || g), ' ') AS body
                                            FROM generate_series(1, 18) AS g) t""",
            (CHUNKS_PER_DOCUMENT,),
        )
        models.ensure_model(conn, a)
        transitions.enqueue_missing(conn, 3)
        conn.execute("""INSERT INTO app.embeddings (chunk_checksum, model_id, embedding)
                        SELECT k.chunk_checksum, k.model_id, array_fill(0.25, ARRAY[16])::vector
                        FROM app.job_keys k WHERE k.job_id % 2 = 0""")
        conn.execute("UPDATE app.embedding_jobs SET status = 'ready' WHERE job_id % 2 = 0")
        conn.execute("UPDATE app.embedding_jobs SET status = 'failed', attempts = 3 WHERE job_id % 100 = 1")
        models.ensure_model(conn, b)
        chunks = conn.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
    with db.connect(url) as conn:
        conn.execute("VACUUM ANALYZE")
    return {"documents": documents, "chunks": chunks}


def median_seconds(fn, repeat: int) -> tuple[float, estimate.Estimate]:
    times, result = [], None
    for _ in range(repeat):
        with Timer() as t:
            result = fn()
        times.append(t.seconds)
    assert result is not None
    return round(statistics.median(times), 3), result


def naive(url: str, model_id: str) -> tuple[float, int, int]:
    """The baseline: every input's text into Python, counted with cl100k."""
    enc = get_encoding()
    with Timer() as t, db.connect(url) as conn, conn.transaction(), conn.cursor(name="texts") as cur:
        cur.execute(
            """SELECT DISTINCT ON (c.chunk_checksum) c.text FROM app.chunks c
                       WHERE NOT EXISTS (SELECT 1 FROM app.embeddings e
                                         WHERE e.chunk_checksum = c.chunk_checksum AND e.model_id = %s)""",
            (model_id,),
        )
        inputs = tokens = 0
        for (text,) in cur:
            inputs += 1
            tokens += len(enc.encode_ordinary(text))
    return round(t.seconds, 3), inputs, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--documents", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    a, b = spec("text-embedding-3-small"), spec("text-embedding-3-large")
    result: dict = {"benchmark": "b14_cost_estimate", "load_before": os.getloadavg()}
    with fresh_database("estimate") as url:
        with Timer() as t:
            result["corpus"] = load(url, args.documents, a, b)
        result["load_seconds"] = round(t.seconds, 1)
        settle(url)
        pool = db.make_pool(url, min_size=1, max_size=2)
        try:
            with pool.connection() as conn:
                pks = [r[0] for r in conn.execute("SELECT doc_pk FROM app.documents ORDER BY doc_pk LIMIT 10000")]
            cases = {
                "corpus_model_a": lambda: estimate.for_corpus(pool, a, None),
                "corpus_model_b": lambda: estimate.for_corpus(pool, b, None),
                "one_bucket": lambda: estimate.for_buckets(pool, a, None, Path(ROOT), [7], BUCKETS),
                "all_buckets": lambda: estimate.for_buckets(pool, a, None, Path(ROOT), range(BUCKETS), BUCKETS),
                "documents_10000": lambda: estimate.for_documents(pool, a, None, pks),
            }
            for name, fn in cases.items():
                seconds, est = median_seconds(fn, args.repeat)
                result[name] = {
                    "seconds": seconds,
                    "send_inputs": est.send_inputs,
                    "send_tokens": est.send_tokens,
                    "embedded": est.embedded,
                    "chunks": est.chunks,
                    "inputs": est.inputs,
                }
        finally:
            pool.close()
        seconds, inputs, _tokens = naive(url, b.model_id)
        result["naive_texts_in_python"] = {"seconds": seconds, "inputs": inputs}
        result["speedup_vs_naive"] = round(seconds / result["corpus_model_b"]["seconds"], 1)
        assert inputs == result["corpus_model_b"]["send_inputs"], "the baseline and the estimate disagree on inputs"
    result["load_after"] = os.getloadavg()
    result["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    emit(result)


if __name__ == "__main__":
    main()
