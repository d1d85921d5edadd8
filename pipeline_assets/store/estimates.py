"""The sums behind a cost estimate (SQL: ``sql/queries/estimates.sql``): for one model and a
selection of current chunks, their distinct content and cl100k tokens, how much of it has a
vector for the model already, and how much is dead-lettered. Each returns
{chunks, inputs, tokens, embedded, embedded_tokens, failed, failed_tokens}."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pipeline_assets.store import arrays, queries

ESTIMATES = queries.load("estimates")


def of_corpus(conn: psycopg.Connection, model_id: str) -> dict[str, int]:
    """Every current chunk."""
    return _summary(conn, ESTIMATES.corpus, {"model": model_id})


def of_documents(conn: psycopg.Connection, model_id: str, pks: Sequence[int]) -> dict[str, int]:
    """The current chunks of some documents (keys)."""
    return _summary(conn, ESTIMATES.documents, {"model": model_id, "pks": arrays.int8(conn, pks)})


def of_buckets(
    conn: psycopg.Connection, model_id: str, root: Path | str, bucket_ids: Sequence[int], bucket_count: int
) -> dict[str, int]:
    """The current chunks of a source's documents in some buckets (of ``bucket_count``)."""
    return _summary(
        conn,
        ESTIMATES.buckets,
        {"model": model_id, "root": str(root), "n": bucket_count, "buckets": sorted(set(bucket_ids))},
    )


def _summary(conn: psycopg.Connection, wanted: str, params: dict) -> dict[str, int]:
    """The summary (``ESTIMATES.summary``) over the selection ``wanted`` (a named query)."""
    query = sql.SQL(ESTIMATES.summary).format(wanted=sql.SQL(wanted))
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(query, params).fetchone()
    if row is None:
        raise LookupError("an estimate aggregate returned no row")
    return {k: int(v) for k, v in row.items()}
