"""Which ingests are running: a row per ingest in ``app.running_ingests``, kept alive by a
beat from a thread on its own connection, deleted when the ingest ends.

Whoever builds a vector index when its queue drains (a worker; an in-process embeddings run
whose model's queue is idle at its end) decides with ``index_build_decision``: no build while
an ingest runs, since an index built while an ingest still inserts is maintained by every
later insert (over twice the cost of one build after them). Plain rows with an expiry, not session locks:
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

# What a drained queue does about its model's missing vector index (``index_build_decision``).
BUILD = "build"  # build it now
WAIT = "wait"  # the queue has not stayed empty for the builder's quiet period yet
PUT_OFF = "put off"  # an ingest is running: left to the next drain after it (``PUT_OFF_BUILDER``)

# Who builds an index put off for an ingest (said in the log line and the run's metadata).
PUT_OFF_BUILDER = (
    "the first drain after the ingests end: a running `work` process whose queue is still empty, "
    "the next `work` or in-process embeddings run whose model's queue drains, or "
    "`pipeline-assets models index`"
)


def any_running(conn: psycopg.Connection) -> bool:
    """Whether an ingest is running anywhere (a row still alive)."""
    return bool(queries.scalar(conn, INGESTS.any_running))


def index_build_decision(
    ingest_running: Callable[[], bool], *, drained_for: float = 0.0, quiet_seconds: float = 0.0
) -> str:
    """The one rule for building a model's missing vector index once its queue drained: WAIT
    while the queue has been empty less than ``quiet_seconds`` (a long-running worker's quiet
    period; a builder that is leaving has none), PUT_OFF while ``ingest_running()``, else BUILD."""
    if drained_for < quiet_seconds:
        return WAIT
    return PUT_OFF if ingest_running() else BUILD


def put_off_line(model_id: str) -> str:
    """The one line saying a drained queue left its index for later, and who builds it."""
    return (
        f"the queue of model {model_id} drained while an ingest runs: its vector index is not built now "
        f"(it would be maintained by every insert of the ingest); it is built by {PUT_OFF_BUILDER}"
    )


@contextmanager
def marked(connect: Callable[[], psycopg.Connection]) -> Iterator[None]:
    """The ingest inside this block is marked running (a row, a beat thread on a connection
    of its own from ``connect``); the row is deleted on the way out, whatever the outcome."""
    params = {
        "ingest": uuid.uuid4(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "alive_for": INGEST_ALIVE_SECONDS,
    }
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
