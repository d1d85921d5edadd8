"""The chunks' text-search vectors (``app.chunks.text_search``), computed after the ingest.

The ingest's chunk COPY writes them NULL (computing them there was most of its cost); ``fill``
computes them, ``FILL_BATCH_CHUNKS`` per transaction, skipping rows another transaction
holds. Full-text search reads a chunk whose vector is still NULL from its text, so every
current chunk is searchable whether it is filled or not; filling only makes it fast.
An ingest fills at its end, unless its caller fills beside other work (``embed``: its
worker, from its first beat with work queued, beside the sending, and again when its queue
drains; ``BackgroundFill``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg

from pipeline_assets.messages import one_line
from pipeline_assets.store import queries
from pipeline_assets.store.background import BackgroundWork

log = logging.getLogger(__name__)

TEXT_SEARCH = queries.load("text_search")

# Chunks whose text-search vectors one transaction of the fill computes.
FILL_BATCH_CHUNKS = 2_000


def fill(conn: psycopg.Connection, stop: threading.Event | None = None) -> int:
    """Compute the text-search vectors of the chunks that have none, a batch per transaction,
    until none is left that no other transaction holds (or ``stop`` is set); returns how many."""
    filled = 0
    while stop is None or not stop.is_set():
        with conn.transaction(), conn.cursor() as cur:
            cur.execute(TEXT_SEARCH.fill_pending, {"limit": FILL_BATCH_CHUNKS})
            done = cur.rowcount
        filled += done
        if done < FILL_BATCH_CHUNKS:
            break
    return filled


def pending(conn: psycopg.Connection) -> int:
    """Chunks without a text-search vector yet."""
    return int(queries.scalar(conn, TEXT_SEARCH.pending_count))


class BackgroundFill(BackgroundWork):
    """``fill`` beside a worker's main loop, on a connection of its own; ``cancel`` stops it
    at once (its running batch rolls back). A failure is logged: search reads the text meanwhile."""

    def __init__(
        self, connect: Callable[[], psycopg.Connection], *, on_done: Callable[[], object] | None = None
    ) -> None:
        super().__init__(connect, name="text-search-fill", on_done=on_done)
        self.filled = 0

    def work(self, conn: psycopg.Connection) -> None:
        self.filled = fill(conn, self.stopped)

    def failed(self, exc: Exception) -> None:
        if self.stopped.is_set():
            return  # cancelled: what is left is computed by the next ingest or drain
        log.warning(
            "could not compute the chunks' text-search vectors (search reads their text "
            "meanwhile; the next ingest or drain computes them): %s",
            one_line(exc),
        )
