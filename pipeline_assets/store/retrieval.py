"""Reading the index (SQL: ``sql/queries/retrieval.sql``): export of current embeddings, the
nearest chunks by vector, the chunks ranked by full-text search, and distances to some chunks.

All go through app.chunks (current chunks of current documents only), so a superseded or
tombstoned vector is never returned. Export streams through a server-side cursor in a read-only
transaction (``EXPORT_FETCH_ROWS`` at a time: memory flat in the corpus).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pipeline_assets.store import queries

RETRIEVAL = queries.load("retrieval")

# BM25's term-frequency saturation (k1) and length normalisation (b), the
# usual values: a word's fifth occurrence in a chunk adds far less than its first.
BM25_K1 = 1.2
BM25_B = 0.75

# A query word in more than this share of the chunks, and in more than
# TEXT_COMMON_FLOOR chunks, does not select chunks for text search (it still
# scores in those the other words select): that bounds the chunks one search
# scores by about (query words) x max(share x chunks, floor). On a corpus of
# fewer than TEXT_COMMON_FLOOR / TEXT_COMMON_RATIO chunks every word selects.
TEXT_COMMON_RATIO = 0.1
TEXT_COMMON_FLOOR = 1000

# Rows an export holds in memory at once (one FETCH from its server-side cursor).
EXPORT_FETCH_ROWS = 500

# The name of export's server-side cursor (pg_cursors shows it while an export runs).
EXPORT_CURSOR = "export_embeddings"


def export_rows(conn: psycopg.Connection, model_id: str) -> Iterator[dict]:
    """Current embeddings of a model, streamed from a server-side cursor.

    Opens its own transaction (a named cursor lives inside one), so ``conn``
    must not be inside another; closing the generator early rolls it back.
    """
    with conn.transaction():
        conn.execute(RETRIEVAL.read_only)
        with conn.cursor(name=EXPORT_CURSOR, row_factory=dict_row, binary=True) as cur:
            cur.itersize = EXPORT_FETCH_ROWS
            cur.execute(RETRIEVAL.export, {"model": model_id})
            for row in cur:
                row["embedding"] = row["embedding"].to_numpy().tolist()
                yield row


def nearest(
    conn: psycopg.Connection,
    model_id: str,
    query_vector: np.ndarray,
    k: int,
    *,
    dim: int,
    kind: str,
    fetch: int,
    ef_search: int,
) -> list[dict]:
    """The k current chunks nearest to ``query_vector`` (cosine distance, ascending), ordered by the
    model's index expression (``kind`` of ``dim``: an exact scan without an index) over ``fetch``
    candidates, at most ``ef_search`` from the HNSW scan, then by the full-precision distance."""
    query = sql.SQL(RETRIEVAL.nearest).format(kind=sql.Identifier(kind), dim=sql.Literal(int(dim)))
    with conn.transaction():
        conn.execute(RETRIEVAL.set_ef_search, {"ef_search": str(ef_search)})
        with conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                query, {"q": np.asarray(query_vector, dtype=np.float32), "model": model_id, "fetch": fetch, "k": k}
            ).fetchall()
    for row in rows:
        row["distance"] = float(row["distance"])
    return rows


def text_ranked(conn: psycopg.Connection, words: str, k: int) -> list[dict]:
    """The k current chunks ranked highest by BM25 for ``words`` (space-separated plain words)."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            RETRIEVAL.text_ranked,
            {
                "words": words,
                "limit": k,
                "k1": BM25_K1,
                "b": BM25_B,
                "common_ratio": TEXT_COMMON_RATIO,
                "common_floor": TEXT_COMMON_FLOOR,
            },
        ).fetchall()
    for row in rows:
        row["text_rank"] = float(row["text_rank"])
    return rows


def snapshot(conn: psycopg.Connection) -> None:
    """Make the transaction ``conn`` just opened read one snapshot for every statement."""
    conn.execute(RETRIEVAL.snapshot)


def distances(
    conn: psycopg.Connection, model_id: str, query_vector: np.ndarray, checksums: Sequence[bytes]
) -> dict[bytes, float]:
    """{chunk checksum: cosine distance to ``query_vector``} of the chunks the model has a vector for."""
    rows = conn.execute(
        RETRIEVAL.distances,
        {"q": np.asarray(query_vector, dtype=np.float32), "model": model_id, "checksums": list(checksums)},
    ).fetchall()
    return {bytes(checksum): float(distance) for checksum, distance in rows}
