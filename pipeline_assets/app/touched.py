"""Which documents of a source a run changed: what the Dagster layer reports after
a reconciliation (new partitions, new materializations, deleted partitions)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import class_row

from pipeline_assets.store import queries

DOCS = queries.load("documents")


@dataclass(frozen=True)
class TouchedDocument:
    document_id: str
    status: str  # current, quarantined, deleted (tombstoned)
    new: bool  # first seen since ``since``


def touched_since(conn: psycopg.Connection, root: str, since: datetime) -> list[TouchedDocument]:
    """Documents of the source ``root`` (as registered) whose row changed since ``since`` (database clock)."""
    with conn.cursor(row_factory=class_row(TouchedDocument)) as cur:
        return cur.execute(DOCS.touched_since, {"root": root, "since": since}).fetchall()
