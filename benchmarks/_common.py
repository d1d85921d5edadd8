"""Shared helpers for the benchmarks: a fresh database per run, small utilities.

Each benchmark creates its own database (bench_<name>_<random>) on the server
named by PIPELINE_DATABASE_URL, or on the embedded server under PIPELINE_HOME
(default ./.pipeline), migrates it with the project's own migrations, and drops
it at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a clean checkout without installing
    sys.path.insert(0, str(REPO))

from pipeline_assets.settings import Settings  # noqa: E402
from pipeline_assets.store import db, embedded_postgres  # noqa: E402


def server_url() -> str:
    url = os.environ.get("PIPELINE_DATABASE_URL")
    if url:
        return url
    return embedded_postgres.ensure_server(Settings.from_env().home_path)


def with_dbname(url: str, name: str) -> str:
    return psycopg.conninfo.make_conninfo(url, dbname=name)


@contextmanager
def fresh_database(tag: str, keep: bool = False, migrate: bool = True) -> Iterator[str]:
    """CREATE DATABASE bench_<tag>_<rand>, migrate it (unless not ``migrate``: a checkout under test
    migrates it with its own migrations), yield its URL, drop it (unless ``keep``)."""
    server = server_url()
    name = f"bench_{tag}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = with_dbname(server, name)
    try:
        if migrate:
            with db.session(url):
                pass
        yield url
    finally:
        if not keep:
            with psycopg.connect(server, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# How long settle() waits for the server's background work (autovacuum) to end.
SETTLE_TIMEOUT_SECONDS = 60.0


def settle(url: str) -> float:
    """Start a measurement from a quiet server: no autovacuum worker running (one
    triggered by the last measurement's writes would take CPU from this one on a
    2-core machine). No CHECKPOINT: it would make the next measurement write a
    full page image of every page it touches first. Returns the seconds waited."""
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() - started < SETTLE_TIMEOUT_SECONDS:
            busy = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
            ).fetchone()[0]
            if not busy:
                break
            time.sleep(0.2)
    return time.monotonic() - started


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def peak_rss_mb() -> float:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def emit(result: dict) -> None:
    print(json.dumps(result, indent=2, default=str), flush=True)


def rate(n: int, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else float("inf")


def start_fake(*options: str) -> tuple[subprocess.Popen, str]:
    """The fake OpenAI server in a process of its own (``options``: its command line, e.g.
    ``--dim 64 --latency 0.2``); (the process, its base URL) once it serves."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline_assets_tests.fake_openai", "--port", "0", *options],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"fake server did not start: {line!r}")
    return proc, line.split(" ", 1)[1]
