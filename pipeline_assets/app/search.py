"""Search and export use cases: read the index through current chunks only."""

from __future__ import annotations

from typing import Iterator

from psycopg_pool import ConnectionPool

from pipeline_assets.app import retrieval
from pipeline_assets.app.runtime import Runtime


def search(rt: Runtime, pool: ConnectionPool, query: str, k: int) -> list[dict]:
    """The k nearest current chunks to ``query`` under the runtime's model."""
    vector = rt.provider.embed([query]).vectors[0]
    with pool.connection() as conn:
        return retrieval.search(conn, rt.model_id, vector, k)


def export(pool: ConnectionPool, model_id: str) -> Iterator[dict]:
    """Current chunk embeddings of a model, streamed."""
    with pool.connection() as conn:
        yield from retrieval.export_rows(conn, model_id)
