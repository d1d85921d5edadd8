"""The chunks' text-search vectors (``app.chunks.text_search``), computed after the ingest.

The ingest's chunk COPY writes them NULL (computing them there was most of its cost); ``fill``
computes them, ``FILL_BATCH_CHUNKS`` per transaction, skipping rows another transaction
holds. Full-text search reads a chunk whose vector is still NULL from its text, so every
current chunk is searchable whether it is filled or not; filling only makes it fast.
An ingest fills at its end, unless its caller fills beside other work (``embed``: its
worker, when its queue drains, beside the vector index build; ``BackgroundFill``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import psycopg

from pipeline_assets.store import queries

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


class BackgroundFill:
    """``fill`` in a thread, on a connection of its own (a worker's drain, beside its index
    build); ``cancel`` stops it at once (its running batch is cancelled and rolled back). A
    failure is logged: search reads the text meanwhile."""

    def __init__(self, connect: Callable[[], psycopg.Connection], *,
                 on_done: Callable[[], object] | None = None) -> None:
        self._connect = connect
        self._on_done = on_done
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        self.filled = 0
        self.done = False
        self._thread = threading.Thread(target=self._run, name="text-search-fill", daemon=True)

    def start(self) -> BackgroundFill:
        self._thread.start()
        return self

    def cancel(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stop.set()
            if self._conn is not None and not self.done:
                with contextlib.suppress(Exception):
                    self._conn.cancel_safe(timeout=timeout)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            with self._lock:
                if self._stop.is_set():
                    return
                self._conn = self._connect()
            with contextlib.closing(self._conn) as conn:
                self.filled = fill(conn, self._stop)
        except Exception as exc:
            if self._stop.is_set():
                return  # cancelled: what is left is computed by the next ingest or drain
            log.warning("could not compute the chunks' text-search vectors (search reads their text "
                        "meanwhile; the next ingest or drain computes them): %s", " ".join(str(exc).split()))
        finally:
            self.done = True
            if self._on_done is not None:
                self._on_done()
