"""Reading the index: export of current embeddings, nearest-neighbour search.

Both go through app.chunks, which holds only current chunks of current
documents, so a superseded or tombstoned vector can never be returned.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pipeline_assets.jobs import models
from pipeline_assets.store import queries

RETRIEVAL = queries.load("retrieval")

# Candidates fetched from the HNSW index per requested result; current-chunk
# filtering happens after the index scan, so ask for a few more than k.
SEARCH_OVERFETCH = 4


def export_rows(conn: psycopg.Connection, model_id: str) -> Iterator[dict]:
    with (conn.cursor(name="export", row_factory=dict_row) if not conn.autocommit
          else conn.cursor(row_factory=dict_row)) as cur:
        cur.execute(RETRIEVAL.export, {"model": model_id})
        for row in cur:
            row["embedding"] = [float(x) for x in row["embedding"].to_numpy()]
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
    query = sql.SQL(RETRIEVAL.nearest).format(dim=sql.Literal(int(dim)))
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, {"q": np.asarray(query_vector, dtype=np.float32), "model": model_id,
                                   "fetch": k * SEARCH_OVERFETCH, "k": k}).fetchall()
