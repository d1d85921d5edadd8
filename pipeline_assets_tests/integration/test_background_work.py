"""BackgroundWork.cancel stops the work whatever the moment: a statement that begins just
after a cancel is cancelled too, and a slow connect does not hold the cancel up."""

from __future__ import annotations

import threading
import time

import psycopg

from pipeline_assets.store import db
from pipeline_assets.store.background import BackgroundWork

CANCEL_TIMEOUT = 10.0  # far above what cancel needs; far below the statement's 60 s


class SleepsAfterTheCancel(BackgroundWork):
    """Checks nothing between the cancel and its statement: the statement starts after the
    first cancel request was sent (the interleaving the hook forces)."""

    def __init__(self, connect, started: threading.Event) -> None:
        super().__init__(connect, name="test-sleep")
        self.started = started
        self.error: Exception | None = None

    def work(self, conn: psycopg.Connection) -> None:
        self.started.set()
        self.stopped.wait(30)
        time.sleep(0.5)  # the first cancel request has reached an idle session by now
        conn.execute("SELECT pg_sleep(60)")

    def failed(self, exc: Exception) -> None:
        self.error = exc


def test_a_statement_begun_after_the_cancel_is_cancelled_too(database_url):
    started = threading.Event()
    work = SleepsAfterTheCancel(lambda: db.connect(database_url), started).start()
    assert started.wait(30)
    began = time.monotonic()
    work.cancel(timeout=CANCEL_TIMEOUT)
    assert work.done, "the statement begun after the first cancel request is still running"
    assert isinstance(work.error, psycopg.errors.QueryCanceled), work.error
    assert time.monotonic() - began < CANCEL_TIMEOUT


def test_a_slow_connect_does_not_hold_up_the_cancel(database_url):
    release = threading.Event()
    connected = []

    def slow_connect() -> psycopg.Connection:
        release.wait(30)  # the database answers late
        conn = db.connect(database_url)
        connected.append(conn)
        return conn

    started = threading.Event()
    work = SleepsAfterTheCancel(slow_connect, started).start()
    time.sleep(0.2)  # the thread is in connect
    began = time.monotonic()
    work.cancel(timeout=1.0)
    assert time.monotonic() - began < 5.0, "cancel waited for the connect"
    release.set()
    deadline = time.monotonic() + 30
    while not work.done and time.monotonic() < deadline:
        time.sleep(0.05)
    # Once connected, the stopped work never ran: its connection is closed, nothing was started.
    assert work.done and not started.is_set()
    assert connected and connected[0].closed
