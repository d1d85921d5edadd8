"""The database's unavailability is never the items' fault: a worker under a database that turns
read-only (a standby being promoted, a storage guard) and drops its connections (admin_shutdown)
waits, charges nothing and resumes.

A real `work` process against the fake provider; only this module's database turns read-only (the
embedded server is shared): ``ALTER DATABASE ... SET default_transaction_read_only`` reaches new
sessions only, so every backend of the database is terminated too (57P01, then 25006 on every write of
the reconnected sessions). The restore leaves sessions opened meanwhile read-only until the worker
replaces them, as on a standby. ``PIPELINE_TEST_READ_ONLY_HOLD``: seconds read-only once the worker said
it waits (default 2; 20 for a failover by hand). ``PIPELINE_TEST_READ_ONLY_SYSTEM=1`` flips the whole
server (``ALTER SYSTEM`` + reload: sessions turn read-only without ending), for this module alone on a
server of its own.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import psycopg

from pipeline_assets.store import db
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.processes import cli, start_cli, stop_group, wait_until

HOLD_SECONDS = float(os.environ.get("PIPELINE_TEST_READ_ONLY_HOLD", "2"))
WHOLE_SERVER = os.environ.get("PIPELINE_TEST_READ_ONLY_SYSTEM") == "1"


class Lines:
    """A process's stderr, read by a thread (the pipe never fills), searchable."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._lock:
                self.lines.append(line)

    def find(self, needle: str) -> str | None:
        with self._lock:
            return next((line for line in self.lines if needle in line), None)

    def text(self) -> str:
        self._thread.join(10)
        with self._lock:
            return "".join(self.lines)


def _set_read_only(conn: psycopg.Connection, on: bool, *, spare: tuple[int, ...] = ()) -> None:
    """Flip this module's database read-only (ending every session but ``conn``'s and ``spare``) or back."""
    name = conn.info.dbname
    if WHOLE_SERVER:
        conn.execute(
            "ALTER SYSTEM SET default_transaction_read_only = on"
            if on
            else "ALTER SYSTEM RESET default_transaction_read_only"
        )
        conn.execute("SELECT pg_reload_conf()")
        return
    if on:
        conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        # What a promotion does to the old primary's clients: their sessions end (admin_shutdown).
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND pid <> ALL(%s)",
            (list(spare),),
        )
    else:
        conn.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')


def test_a_read_only_database_is_waited_out_and_charges_nothing(env, fake, clean_db, tmp_path, database_url):
    corpus = tmp_path / "c"
    write_corpus(corpus, 60)
    env = {**env, "PIPELINE_BATCH_INPUTS": "2"}
    cli("ingest", str(corpus), env=env)
    conn = clean_db
    texts = [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks")]
    fake.latency = 0.2  # the run lasts long enough to be caught mid-way
    admin = db.connect(database_url)  # its own session: the flip terminates every other backend
    worker = start_cli("work", "--until-idle", "--json", "--concurrency", "2", "--worker-id", "rider", env=env)
    log = Lines(worker.stderr)
    try:
        wait_until(
            lambda: conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0] >= 6,
            interval=0.05,  # a state of a few seconds: caught at a fixed 20 Hz
            what="the worker to be mid-run",
        )
        _set_read_only(admin, True, spare=(conn.info.backend_pid,))
        flipped = time.monotonic()
        wait_until(
            lambda: log.find("database unavailable (") or worker.poll() is not None,
            timeout=60,
            what="the worker's wait line",
        )
        waiting = log.find("database unavailable (")
        assert waiting is not None and worker.poll() is None, f"the worker exited ({worker.poll()}): {log.text()}"
        assert "the worker waits and retries, charging no job" in waiting
        # status says what is true while it waits: the database refuses writes, workers wait.
        status = cli("status", env=env).stdout
        assert (
            "database: READ-ONLY (transaction_read_only = on): workers cannot record progress; they wait" in status
        ), status
        assert json.loads(cli("status", "--json", env=env).stdout)["database"]["read_only"] is True
        time.sleep(HOLD_SECONDS)  # the failover's length: the worker must simply outlast it
        assert worker.poll() is None, log.text()  # still up
        held_for = time.monotonic() - flipped
        _set_read_only(admin, False)
        restored = time.monotonic()
        resumed = wait_until(
            lambda: log.find("database available again after"), timeout=60, what="the worker's resume line"
        )
        resumed_after = time.monotonic() - restored
        waited = float(re.search(r"available again after ([0-9.]+) s", resumed).group(1))
        out, _ = worker.communicate(timeout=120)
    finally:
        _set_read_only(admin, False)
        admin.close()
        if worker.poll() is None:
            stop_group(worker)
    err = log.text()
    print("".join(line for line in err.splitlines(keepends=True) if "pipeline_assets.jobqueue.worker" in line))
    print(
        f"\nread-only for {held_for:.1f} s: the worker waited {waited:.1f} s and resumed "
        f"{resumed_after:.1f} s after the restore (seen by this test's log reader)"
    )
    assert worker.returncode == 0, err
    assert "Traceback" not in err, err
    report = json.loads(out)
    # The corpus completed; nothing dead-lettered, no attempt charged for the pause.
    assert job_counts(conn) == {"ready": len(texts)}
    assert conn.execute("SELECT max(attempts), max(faults) FROM app.embedding_jobs").fetchone() == (1, 0)
    assert report["embedded"] == len(texts) and report.get("failed", 0) == 0
    # Every input billed once: answers that came back while the database was away were
    # stored once it was back (not sent again), and nothing was sent that the ledger did not record.
    assert all(fake.billed_count(t) == 1 for t in texts)
    calls = conn.execute("SELECT count(*), count(*) FILTER (WHERE outcome = 'ok') FROM app.provider_calls").fetchone()
    assert calls == (fake.stats["requests"], fake.stats["requests"])
    assert conn.execute("SELECT coalesce(max(sends), 0) FROM app.input_sends").fetchone()[0] == 1
    assert_vectors_match(conn, fake)
