"""Search and export use cases: read the index through current chunks only.

Vector search orders by the model's HNSW index expression (an exact scan without it) and ranks
candidates again by the full-precision distance. Text search ranks by PostgreSQL full-text search;
hybrid fuses the two rankings by reciprocal rank fusion (``RRF_K``), so a chunk without a vector
is still found by its text (docs/models.md, search). The queries: store/retrieval.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app.runtime import Runtime
from pipeline_assets.registry import models, vector_index
from pipeline_assets.store import retrieval

HYBRID, VECTOR, TEXT = "hybrid", "vector", "text"
# Search modes; the first is the default.
MODES = (HYBRID, VECTOR, TEXT)

# Candidates fetched from the HNSW index per requested result; current-chunk
# filtering happens after the index scan, so ask for a few more than k.
SEARCH_OVERFETCH = 4

# pgvector's upper limit of hnsw.ef_search (a larger value is an error once the
# extension is loaded in the session): at most this many index candidates per search.
HNSW_EF_SEARCH_MAX = 1000

# The fewest HNSW candidates a search asks for, however small k.
HNSW_EF_SEARCH_MIN = 40

# Reciprocal rank fusion's constant: a hit at rank r adds 1 / (RRF_K + r). 60 is
# the value of the original paper; larger flattens the advantage of the top ranks.
RRF_K = 60

# Candidates each ranking contributes to hybrid search (at least k): how deep
# a chunk may sit in one list and still be lifted by the other.
RRF_DEPTH = 50

# The words of a text query (letters and digits); everything else, including
# websearch operators such as quotes and a leading minus, is a separator.
_QUERY_WORD = re.compile(r"[^\W_]+")


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
            hits = text_search(conn, query, k)
        for hit in hits:
            hit.pop("chunk_checksum", None)
            hit.update(distance=None, score=hit["text_rank"])
        return hits
    vector = rt.provider.embed([query]).vectors[0]
    with pool.connection() as conn:
        if mode == VECTOR:
            hits = nearest(conn, model_id, vector, k)
            for hit in hits:
                hit.update(text_rank=None, score=1.0 - hit["distance"])  # cosine similarity
        else:
            hits = hybrid_search(conn, model_id, query, vector, k)
    return hits


def export(pool: ConnectionPool, model_id: str) -> Iterator[dict]:
    """Current chunk embeddings of a model, streamed."""
    with pool.connection() as conn:
        yield from retrieval.export_rows(conn, model_id)


def nearest(conn: psycopg.Connection, model_id: str, query_vector: np.ndarray, k: int) -> list[dict]:
    """The k current chunks nearest to ``query_vector`` (cosine distance, ascending)."""
    dim = models.model_dimension(conn, model_id)
    if not dim:
        return []
    # The HNSW scan yields at most ef_search candidates; ask for enough.
    ef_search = min(HNSW_EF_SEARCH_MAX, max(HNSW_EF_SEARCH_MIN, k * SEARCH_OVERFETCH))
    return retrieval.nearest(
        conn,
        model_id,
        query_vector,
        k,
        dim=int(dim),
        kind=vector_index.search_kind(int(dim)),
        fetch=k * SEARCH_OVERFETCH,
        ef_search=ef_search,
    )


def text_query(query: str) -> str:
    """The words of ``query`` (letters and digits), space-separated: no character of it is ever
    read as tsquery syntax."""
    return " ".join(_QUERY_WORD.findall(query))


def text_search(conn: psycopg.Connection, query: str, k: int) -> list[dict]:
    """The k current chunks ranked highest by full-text search (BM25) for ``query``; none if no
    word of it is in any chunk."""
    words = text_query(query)
    return retrieval.text_ranked(conn, words, k) if words else []


def hybrid_search(conn: psycopg.Connection, model_id: str, query: str, query_vector: np.ndarray, k: int) -> list[dict]:
    """The k best current chunks by reciprocal rank fusion of the vector and the text ranking.

    Each hit carries ``score`` (the fused score, descending), ``distance`` (the
    cosine distance; None when the chunk has no vector under the model yet)
    and ``text_rank`` (None when no query word is in it).
    """
    depth = max(k, RRF_DEPTH)
    outermost = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with conn.transaction():
        if outermost:
            retrieval.snapshot(conn)
        by_vector = nearest(conn, model_id, query_vector, depth)
        by_text = text_search(conn, query, depth)
        hits = _fuse(by_vector, by_text, k)
        _fill_distances(conn, model_id, query_vector, [h for h in hits if h["distance"] is None])
    for hit in hits:
        hit.pop("chunk_checksum", None)
    return hits


def _fuse(by_vector: list[dict], by_text: list[dict], k: int) -> list[dict]:
    """Reciprocal rank fusion of two rankings of current chunks: the k best, score descending."""
    fused: dict[tuple[str, int], dict] = {}
    for ranking in (by_vector, by_text):
        for rank, row in enumerate(ranking, start=1):
            hit = fused.setdefault(
                (row["document_id"], row["chunk_index"]), {**row, "distance": None, "text_rank": None, "score": 0.0}
            )
            hit["score"] += 1.0 / (RRF_K + rank)
            hit.update({key: row[key] for key in ("distance", "text_rank", "chunk_checksum") if key in row})
    return sorted(fused.values(), key=lambda h: (-h["score"], h["document_id"], h["chunk_index"]))[:k]


def _fill_distances(conn: psycopg.Connection, model_id: str, query_vector: np.ndarray, hits: list[dict]) -> None:
    """The distance of hits found by text only, where the model has their vector."""
    checksums = [h["chunk_checksum"] for h in hits if "chunk_checksum" in h]
    if not checksums:
        return
    found = retrieval.distances(conn, model_id, query_vector, checksums)
    for hit in hits:
        hit["distance"] = found.get(bytes(hit["chunk_checksum"]))
