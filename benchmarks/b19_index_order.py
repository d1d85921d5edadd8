"""B19, the end of `embed`: when to build a fresh model's HNSW index, measured.

N random vectors inserted in the worker's completion batches into a table shaped like app.embeddings
with the same partial HNSW index (CONCURRENTLY, maintenance_work_mem 512 MB), in three orders, a fresh
database each, alternating: `after` (the inserts, then one bulk build: what `embed` and a draining
worker do), `before` (the build on the empty table, then the inserts) and `concurrent` (the build
started after the first batch, beside the rest). `ratio_<order>` = its wall time / after's (above 1:
after is cheaper); an order past --cap-seconds stops and reports the rows it had inserted.

    python benchmarks/b19_index_order.py [--vectors 13333] [--dim 256] [--rounds 1]
    python benchmarks/b19_index_order.py --vectors 100000 --orders after,before --cap-seconds 120
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np
import psycopg
from _common import emit, fresh_database, settle
from pgvector.psycopg import register_vector

from pipeline_assets.settings import Settings

BUILD_MEMORY = "512MB"
ORDERS = ("after", "before", "concurrent")


def insert(url: str, vectors: np.ndarray, batch: int, first: int, deadline: float) -> int:
    """Insert ``vectors`` (keys from ``first``) one batch a statement; stop at ``deadline``.
    Returns the rows inserted."""
    done = 0
    with psycopg.connect(url, autocommit=True) as conn:
        register_vector(conn)
        for start in range(0, len(vectors), batch):
            if time.perf_counter() > deadline:
                break
            part = vectors[start : start + batch]
            keys = [(first + start + i).to_bytes(8, "big") for i in range(len(part))]
            conn.execute(
                "INSERT INTO bench_embeddings (chunk_checksum, model_id, embedding)"
                " SELECT k, 'm', v FROM unnest(%s::bytea[], %s::vector[]) AS u(k, v)",
                (keys, list(part)),
            )
            done += len(part)
    return done


def build(url: str, dim: int) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"SET maintenance_work_mem = '{BUILD_MEMORY}'")
        started = time.perf_counter()
        conn.execute(
            f"CREATE INDEX CONCURRENTLY bench_hnsw ON bench_embeddings USING hnsw"
            f" ((embedding::vector({dim})) vector_cosine_ops) WHERE model_id = 'm'"
        )
        return time.perf_counter() - started


def one(order: str, vectors: np.ndarray, batch: int, cap: float) -> dict:
    n, dim = vectors.shape
    with fresh_database("ixorder") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE bench_embeddings (chunk_checksum bytea, model_id text,"
                " embedding vector NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),"
                " PRIMARY KEY (chunk_checksum, model_id))"
            )
        settle(url)
        started = time.perf_counter()
        deadline = started + cap
        if order == "after":
            rows = insert(url, vectors, batch, 0, deadline)
            build_s = build(url, dim) if rows == n else 0.0
        elif order == "before":
            build_s = build(url, dim)
            rows = insert(url, vectors, batch, 0, deadline)
        else:
            rows = insert(url, vectors[:batch], batch, 0, deadline)
            built: list[float] = []
            builder = threading.Thread(target=lambda: built.append(build(url, dim)))
            builder.start()
            rows += insert(url, vectors[batch:], batch, batch, deadline)
            builder.join()
            build_s = built[0]
        total = time.perf_counter() - started
        if rows == n:
            with psycopg.connect(url) as conn:
                valid = conn.execute(
                    "SELECT indisvalid FROM pg_index WHERE indexrelid = 'bench_hnsw'::regclass"
                ).fetchone()[0]
                assert valid, order
    return {
        "order": order,
        "rows": rows,
        "complete": rows == n,
        "total_s": round(total, 3),
        "build_s": round(build_s, 3),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vectors", type=int, default=13_333)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--orders", default=",".join(ORDERS))
    p.add_argument("--cap-seconds", type=float, default=600.0)
    a = p.parse_args()
    orders = a.orders.split(",")
    assert "after" in orders and set(orders) <= set(ORDERS), orders
    batch = Settings.from_env().provider_config().request_inputs
    vectors = np.random.default_rng(0).standard_normal((a.vectors, a.dim), dtype=np.float32)
    rounds = [[one(order, vectors, batch, a.cap_seconds) for order in orders] for _ in range(a.rounds)]
    after = statistics.median(r["total_s"] for rnd in rounds for r in rnd if r["order"] == "after")
    ratios = {
        f"ratio_{o}": round(
            statistics.median(r["total_s"] for rnd in rounds for r in rnd if r["order"] == o) / after, 2
        )
        for o in orders
        if o != "after"
    }
    emit(
        {
            "vectors": a.vectors,
            "dim": a.dim,
            "batch": batch,
            "rounds": a.rounds,
            "after_s": after,
            **ratios,
            "capped": any(not r["complete"] for rnd in rounds for r in rnd),
            "rounds_raw": rounds,
        }
    )


if __name__ == "__main__":
    main()
