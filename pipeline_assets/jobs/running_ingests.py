"""Which ingests are running: a row per ingest in ``app.running_ingests``, kept alive by a
beat from a thread on its own connection, deleted when the ingest ends.

A worker whose queue drains asks ``any_running`` before it builds a vector index: an
index built while an ingest still inserts is maintained by every later insert (over
twice the cost of one build after them). Plain rows with an expiry, not session locks:
the check holds across processes and hosts and through a transaction-pooling PgBouncer,
and a killed ingest stops counting ``INGEST_ALIVE_SECONDS`` after its last beat.
The mark is advisory: when it cannot be written the ingest goes on unmarked.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg

from pipeline_assets.store import queries
from pipeline_assets.store.db import DatabaseUnavailable

log = logging.getLogger(__name__)

INGESTS = queries.load("running_ingests")

# A running ingest's row is alive this long after its last beat...
INGEST_ALIVE_SECONDS = 15.0
# ...and it beats this often.
INGEST_BEAT_SECONDS = 3.0


def any_running(conn: psycopg.Connection) -> bool:
    """Whether an ingest is running anywhere (a row still alive)."""
    return bool(queries.scalar(conn, INGESTS.any_running))


@contextmanager
def marked(connect: Callable[[], psycopg.Connection]) -> Iterator[None]:
    """The ingest inside this block is marked running (a row, a beat thread on a connection
    of its own from ``connect``); the row is deleted on the way out, whatever the outcome."""
    params = {"ingest": uuid.uuid4(), "host": socket.gethostname(), "pid": os.getpid(),
              "alive_for": INGEST_ALIVE_SECONDS}
    try:
        conn = connect()
    except (psycopg.Error, DatabaseUnavailable) as exc:
        log.info("the ingest is not marked running (workers may build the vector index early): %s", exc)
        yield
        return
    stop = threading.Event()
    beats = threading.Thread(target=_beat, args=(conn, params, stop), name="ingest-mark", daemon=True)
    try:
        conn.execute(INGESTS.begin, params)
        beats.start()
    except psycopg.Error as exc:  # a read-only database, a role without the table: the ingest says so itself
        log.info("the ingest is not marked running (workers may build the vector index early): %s", exc)
    try:
        yield
    finally:
        stop.set()
        try:
            if beats.is_alive():
                beats.join()
                conn.execute(INGESTS.finish, params)
        except psycopg.Error as exc:  # the row stops counting once its beat expires
            log.info("could not clear the ingest's running mark (it expires): %s", exc)
        finally:
            conn.close()


def _beat(conn: psycopg.Connection, params: dict, stop: threading.Event) -> None:
    while not stop.wait(INGEST_BEAT_SECONDS):
        try:
            conn.execute(INGESTS.beat, params)
        except psycopg.Error as exc:  # a missed beat is harmless unless the window passes
            log.debug("ingest beat failed: %s", exc)
