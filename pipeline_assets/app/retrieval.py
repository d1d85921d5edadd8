"""Reading the index: export of current embeddings; vector, text and hybrid search.

All go through app.chunks (current chunks of current documents only), so a superseded or
tombstoned vector is never returned. Export streams through a server-side cursor in a read-only
transaction (``EXPORT_FETCH_ROWS`` at a time: memory flat in the corpus). Vector search orders by
the model's HNSW index expression (an exact scan without it) and ranks candidates again by the
full-precision distance. Text search ranks by PostgreSQL full-text search; hybrid fuses the two
rankings by reciprocal rank fusion (``RRF_K``), so a chunk without a vector is still found by its
text (docs/models.md, search).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pipeline_assets.registry import models, vector_index
from pipeline_assets.store import queries

RETRIEVAL = queries.load("retrieval")

# Candidates fetched from the HNSW index per requested result; current-chunk
# filtering happens after the index scan, so ask for a few more than k.
SEARCH_OVERFETCH = 4

# pgvector's upper limit of hnsw.ef_search (a larger value is an error once the
# extension is loaded in the session): at most this many index candidates per search.
HNSW_EF_SEARCH_MAX = 1000

# Reciprocal rank fusion's constant: a hit at rank r adds 1 / (RRF_K + r). 60 is
# the value of the original paper; larger flattens the advantage of the top ranks.
RRF_K = 60

# Candidates each ranking contributes to hybrid search (at least k): how deep
# a chunk may sit in one list and still be lifted by the other.
RRF_DEPTH = 50

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

# The words of a text query (letters and digits); everything else, including
# websearch operators such as quotes and a leading minus, is a separator.
_QUERY_WORD = re.compile(r"[^\W_]+")

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
    """The k current chunks nearest to ``query_vector`` (cosine distance, ascending)."""
    dim = models.model_dimension(conn, model_id)
    if not dim:
        return []
    dim = int(dim)
    with conn.transaction():
        # The HNSW scan yields at most ef_search candidates; ask for enough.
        ef_search = min(HNSW_EF_SEARCH_MAX, max(40, k * SEARCH_OVERFETCH))
        conn.execute(RETRIEVAL.set_ef_search, {"ef_search": str(ef_search)})
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


def text_query(query: str) -> str:
    """The words of ``query`` (letters and digits), space-separated: no character of it is ever
    read as tsquery syntax."""
    return " ".join(_QUERY_WORD.findall(query))


def text_search(conn: psycopg.Connection, query: str, k: int) -> list[dict]:
    """The k current chunks ranked highest by full-text search (BM25) for ``query``; none if no
    word of it is in any chunk."""
    words = text_query(query)
    if not words:
        return []
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(RETRIEVAL.text_ranked, {"words": words, "limit": k, "k1": BM25_K1, "b": BM25_B,
                                                   "common_ratio": TEXT_COMMON_RATIO,
                                                   "common_floor": TEXT_COMMON_FLOOR}).fetchall()
    for row in rows:
        row["text_rank"] = float(row["text_rank"])
    return rows


def hybrid_search(conn: psycopg.Connection, model_id: str, query: str, query_vector: np.ndarray,
                  k: int) -> list[dict]:
    """The k best current chunks by reciprocal rank fusion of the vector and the text ranking.

    Each hit carries ``score`` (the fused score, descending), ``distance`` (the
    cosine distance; None when the chunk has no vector under the model yet)
    and ``text_rank`` (None when no query word is in it).
    """
    depth = max(k, RRF_DEPTH)
    outermost = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with conn.transaction():
        if outermost:
            conn.execute(RETRIEVAL.snapshot)
        by_vector = search(conn, model_id, query_vector, depth)
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
            hit = fused.setdefault((row["document_id"], row["chunk_index"]),
                                   {**row, "distance": None, "text_rank": None, "score": 0.0})
            hit["score"] += 1.0 / (RRF_K + rank)
            hit.update({key: row[key] for key in ("distance", "text_rank", "chunk_checksum") if key in row})
    return sorted(fused.values(), key=lambda h: (-h["score"], h["document_id"], h["chunk_index"]))[:k]


def _fill_distances(conn: psycopg.Connection, model_id: str, query_vector: np.ndarray, hits: list[dict]) -> None:
    """The distance of hits found by text only, where the model has their vector."""
    checksums = [h["chunk_checksum"] for h in hits if "chunk_checksum" in h]
    if not checksums:
        return
    rows = conn.execute(RETRIEVAL.distances, {"q": np.asarray(query_vector, dtype=np.float32), "model": model_id,
                                               "checksums": checksums}).fetchall()
    found = {bytes(checksum): float(distance) for checksum, distance in rows}
    for hit in hits:
        hit["distance"] = found.get(bytes(hit["chunk_checksum"]))
