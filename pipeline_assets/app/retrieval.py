"""Reading the index: export of current embeddings, nearest-neighbour search.

Both go through app.chunks, which holds only current chunks of current
documents, so a superseded or tombstoned vector can never be returned.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import psycopg

from pipeline_assets.jobs import models

# Candidates fetched from the HNSW index per requested result; current-chunk
# filtering happens after the index scan, so ask for a few more than k.
SEARCH_OVERFETCH = 4

EXPORT = """
SELECT d.document_id, d.source_uri, c.chunk_index, c.text, m.name, e.embedding
FROM app.chunks c
JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current'
JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %(model)s
JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum AND k.model_id = %(model)s
JOIN app.embedding_jobs j ON j.job_id = k.job_id AND j.status = 'ready'
JOIN app.models m ON m.model_id = e.model_id
ORDER BY d.document_id, c.chunk_index
"""


def export_rows(conn: psycopg.Connection, model_id: str) -> Iterator[dict]:
    with conn.cursor(name="export") if not conn.autocommit else conn.cursor() as cur:
        cur.execute(EXPORT, {"model": model_id})
        for doc, uri, idx, text, name, vec in cur:
            yield {"document_id": doc, "source_uri": uri, "chunk_index": idx, "text": text, "model": name,
                   "embedding": [float(x) for x in vec.to_numpy()]}


def search(conn: psycopg.Connection, model_id: str, query_vector: np.ndarray, k: int) -> list[dict]:
    dim = models.model_dimension(conn, model_id)
    if not dim:
        return []
    dim = int(dim)
    with conn.transaction():
        # The HNSW scan yields at most ef_search candidates; ask for enough.
        conn.execute("SELECT set_config('hnsw.ef_search', %s, true)", (str(max(40, k * SEARCH_OVERFETCH)),))
        rows = _nearest(conn, dim, model_id, query_vector, k)
    return [{"document_id": d, "source_uri": u, "chunk_index": i, "text": t, "distance": float(dist)}
            for d, u, i, t, dist in rows]


def _nearest(conn: psycopg.Connection, dim: int, model_id: str, query_vector: np.ndarray, k: int) -> list:
    return conn.execute(
        f"""WITH nearest AS (
                SELECT e.chunk_checksum, e.embedding::vector({dim}) <=> %(q)s::vector({dim}) AS distance
                FROM app.embeddings e
                WHERE e.model_id = %(model)s
                ORDER BY e.embedding::vector({dim}) <=> %(q)s::vector({dim})
                LIMIT %(fetch)s)
            SELECT d.document_id, d.source_uri, c.chunk_index, c.text, n.distance
            FROM nearest n
            JOIN app.chunks c ON c.chunk_checksum = n.chunk_checksum
            JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current'
            ORDER BY n.distance, d.document_id, c.chunk_index
            LIMIT %(k)s""",
        {"q": np.asarray(query_vector, dtype=np.float32), "model": model_id, "fetch": k * SEARCH_OVERFETCH,
         "k": k},
    ).fetchall()
