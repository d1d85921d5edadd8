"""Reading the index: export of current embeddings, nearest-neighbour search.

Both go through app.chunks, which holds only current chunks of current
documents, so a superseded or tombstoned vector can never be returned.

Export streams: a named (server-side) cursor inside a read-only transaction,
fetched ``EXPORT_FETCH_ROWS`` at a time, so memory does not grow with the
corpus. Search orders by the expression of the model's HNSW index (a
``halfvec`` cast above 2,000 dimensions, see ``jobs.vector_index``); without
the index it is an exact scan, and the candidates are ranked again by the
full-precision distance either way.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pipeline_assets.jobs import models, vector_index
from pipeline_assets.store import queries

RETRIEVAL = queries.load("retrieval")

# Candidates fetched from the HNSW index per requested result; current-chunk
# filtering happens after the index scan, so ask for a few more than k.
SEARCH_OVERFETCH = 4

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


def search(conn: psycopg.Connection, model_id: str, query_vector: np.ndarray, k: int) -> list[dict]:
    dim = models.model_dimension(conn, model_id)
    if not dim:
        return []
    dim = int(dim)
    with conn.transaction():
        # The HNSW scan yields at most ef_search candidates; ask for enough.
        conn.execute(RETRIEVAL.set_ef_search, {"ef_search": str(max(40, k * SEARCH_OVERFETCH))})
        rows = _nearest(conn, dim, model_id, query_vector, k)
    for row in rows:
        row["distance"] = float(row["distance"])
    return rows


def _nearest(conn: psycopg.Connection, dim: int, model_id: str, query_vector: np.ndarray, k: int) -> list[dict]:
    query = sql.SQL(RETRIEVAL.nearest).format(kind=sql.Identifier(vector_index.search_kind(dim)),
                                              dim=sql.Literal(int(dim)))
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, {"q": np.asarray(query_vector, dtype=np.float32), "model": model_id,
                                   "fetch": k * SEARCH_OVERFETCH, "k": k}).fetchall()
