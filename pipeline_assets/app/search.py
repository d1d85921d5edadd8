"""Search and export use cases: read the index through current chunks only."""

from __future__ import annotations

from collections.abc import Iterator

from psycopg_pool import ConnectionPool

from pipeline_assets.app import retrieval
from pipeline_assets.app.runtime import Runtime

HYBRID, VECTOR, TEXT = "hybrid", "vector", "text"
# Search modes; the first is the default.
MODES = (HYBRID, VECTOR, TEXT)


def search(rt: Runtime, pool: ConnectionPool, query: str, k: int, mode: str = HYBRID) -> list[dict]:
    """The k best current chunks for ``query``.

    ``hybrid`` fuses the vector and the full-text ranking (reciprocal rank
    fusion), ``vector`` is the nearest chunks by cosine distance, ``text``
    full-text search alone (no provider call). Every hit carries ``distance``
    (None where the chunk has no vector yet, or in text mode), ``text_rank``
    (None where no query word is in the chunk, or in vector mode) and
    ``score``, by which the hits are ordered (descending).
    """
    if mode not in MODES:
        raise ValueError(f"unknown search mode {mode!r} (one of {', '.join(MODES)})")
    # The model whose vectors answer the query.
    model_id = rt.model_id
    if mode == TEXT:
        with pool.connection() as conn:
            hits = retrieval.text_search(conn, query, k)
        for hit in hits:
            hit.pop("chunk_checksum", None)
            hit.update(distance=None, score=hit["text_rank"])
        return hits
    vector = rt.provider.embed([query]).vectors[0]
    with pool.connection() as conn:
        if mode == VECTOR:
            hits = retrieval.search(conn, model_id, vector, k)
            for hit in hits:
                hit.update(text_rank=None, score=1.0 - hit["distance"])  # cosine similarity
        else:
            hits = retrieval.hybrid_search(conn, model_id, query, vector, k)
    return hits


def export(pool: ConnectionPool, model_id: str) -> Iterator[dict]:
    """Current chunk embeddings of a model, streamed."""
    with pool.connection() as conn:
        yield from retrieval.export_rows(conn, model_id)
