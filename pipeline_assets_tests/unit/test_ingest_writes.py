"""The ingest's database thread: transactions in the order queued, lookups before the waiting
ones, the first error raised in the caller and nothing run after it."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline_assets.app.ingest_writes import DatabaseThread

WAIT_SECONDS = 30.0


def test_lookups_run_before_the_transactions_waiting_and_these_in_order():
    ran, done = [], []
    gate, started = threading.Event(), threading.Event()

    def first():
        started.set()
        gate.wait(WAIT_SECONDS)
        ran.append("w1")
        return "w1"

    with DatabaseThread(writes_ahead=10) as db:
        db.write(done.append, first)
        assert started.wait(WAIT_SECONDS)  # running: the others wait behind it
        db.write(done.append, lambda: ran.append("w2") or "w2")
        db.write(done.append, lambda: ran.append("w3") or "w3")
        looked = db.lookup(lambda: ran.append("lookup") or "known")
        gate.set()
        assert db.result(looked) == "known"
        db.finish()
    assert ran == ["w1", "lookup", "w2", "w3"] and done == ["w1", "w2", "w3"]


def test_the_first_error_is_the_callers_and_what_was_queued_after_it_does_not_run():
    ran = []

    def fail():
        raise ValueError("a write failed")

    with DatabaseThread(writes_ahead=10) as db:
        db.write(ran.append, lambda: "w1")
        db.write(ran.append, fail)
        db.write(ran.append, lambda: ran.append("w3 ran") or "w3")
        with pytest.raises(ValueError, match="a write failed"):
            db.finish()
        with pytest.raises(ValueError, match="a write failed"):
            db.result(db.lookup(lambda: ran.append("lookup ran")))
    assert ran == ["w1"]


def test_at_most_writes_ahead_transactions_are_queued():
    gate, started = threading.Event(), threading.Event()
    queued = []

    def first():
        started.set()
        gate.wait(WAIT_SECONDS)

    with DatabaseThread(writes_ahead=2) as db:
        db.write(queued.append, first)
        assert started.wait(WAIT_SECONDS)
        db.write(queued.append, lambda: "second")
        caller = threading.Thread(target=db.write, args=(queued.append, lambda: "third"))
        caller.start()
        caller.join(0.2)
        assert caller.is_alive() and queued == []  # the third waits for the first to commit
        gate.set()
        caller.join(WAIT_SECONDS)
        assert not caller.is_alive()
        db.finish()
    assert queued == [None, "second", "third"]


def test_leaving_on_an_error_of_the_callers_still_commits_what_was_queued():
    ran = []
    with pytest.raises(RuntimeError), DatabaseThread(writes_ahead=10) as db:
        db.write(ran.append, lambda: ran.append("w1"))
        db.write(ran.append, lambda: ran.append("w2"))
        raise RuntimeError("the listing failed")
    assert ran == ["w1", "w2"]


def test_an_interrupt_cancels_the_statement_running_and_skips_the_rest():
    ran = []
    released, started = threading.Event(), threading.Event()

    def stuck():  # a statement waiting on a lock, say, until the server cancels it
        started.set()
        if not released.wait(WAIT_SECONDS):
            ran.append("never cancelled")
        raise RuntimeError("canceling statement due to user request")

    with pytest.raises(KeyboardInterrupt), DatabaseThread(writes_ahead=10, cancel=released.set) as db:
        db.write(ran.append, stuck)
        db.write(ran.append, lambda: ran.append("after"))
        assert started.wait(WAIT_SECONDS)
        raise KeyboardInterrupt
    assert ran == []


def test_an_interrupt_also_cancels_a_statement_begun_after_its_first_cancel():
    """The first cancel request reaches a statement that ends by itself; the next statement of the
    same transaction then waits on a lock: the cancel is sent again while the thread lives."""
    ran = []
    first_running, waiting, released = threading.Event(), threading.Event(), threading.Event()
    cancels = []

    def transaction():
        first_running.set()
        time.sleep(0.5)  # a statement the first cancel request reaches, or misses: it ends anyway
        waiting.set()  # the next statement: a lock wait only a cancel ends
        if not released.wait(WAIT_SECONDS):
            ran.append("never cancelled")
        raise RuntimeError("canceling statement due to user request")

    def cancel():  # the server ends only the statement running when the request arrives
        cancels.append(waiting.is_set())
        if waiting.is_set():
            released.set()

    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt), DatabaseThread(writes_ahead=10, cancel=cancel) as db:
        db.write(ran.append, transaction)
        assert first_running.wait(WAIT_SECONDS)
        raise KeyboardInterrupt
    assert ran == [] and released.is_set(), (ran, cancels)
    assert cancels[0] is False and cancels[-1] is True  # the first request came before the lock wait
    assert time.monotonic() - began < WAIT_SECONDS / 2
