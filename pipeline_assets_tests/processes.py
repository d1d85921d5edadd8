"""The processes the tests start: the CLI run in the test process or as a real one (``cli``,
``start_cli``), a process group stopped whole, the session's leftovers found by their marker, and
``wait_until``, the bounded wait every test uses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent  # the CLI's working directory

# Every process this test process starts inherits this marker (one value per xdist worker), so what
# the suite started can be found at the end even after it was re-parented or left its session. Not
# PIPELINE_-prefixed: the tests that build a clean environment drop those, and must keep this one.
SESSION_MARKER = "PYTEST_PIPELINE_SESSION"
os.environ[SESSION_MARKER] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def marked_processes(needle: str = "") -> list[psutil.Process]:
    """Live processes started (directly or not) by this test process whose command line contains needle."""
    me, found = os.environ[SESSION_MARKER], []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (
                p.pid != os.getpid()
                and needle in " ".join(p.info["cmdline"] or [])
                and p.status() != psutil.STATUS_ZOMBIE
                and p.environ().get(SESSION_MARKER) == me
            ):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


MULTIPROCESSING_HELPER = "-c from multiprocessing."


def leftover_processes() -> list[psutil.Process]:
    """The live processes this test process started, but for a shared embedded server
    (PIPELINE_TEST_HOME's, which is meant to outlive the session) and its children, and this
    process's multiprocessing helpers (resource tracker, forkserver), which exit with it."""
    kept: set[int] = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if MULTIPROCESSING_HELPER in " ".join(child.cmdline()):
                kept.add(child.pid)
    if os.environ.get("PIPELINE_TEST_HOME"):
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            pid_file = Path(os.environ["PIPELINE_TEST_HOME"]) / "pgdata" / "postmaster.pid"
            postmaster = psutil.Process(int(pid_file.read_text().split()[0]))
            kept |= {postmaster.pid, *(c.pid for c in postmaster.children(recursive=True))}
    return [p for p in marked_processes() if p.pid not in kept]


def cli(
    *args: str, env: dict, timeout: float = 120, check: bool = True, process: bool = False
) -> subprocess.CompletedProcess:
    """`pipeline-assets ARGS` with exactly the environment ``env``: its exit code, stdout and stderr.

    In this test process by default (click's CliRunner): the same command, settings read from
    ``env``, the same exit code and output, without a new interpreter's imports. ``process=True``
    runs it as a real process, for what is about the process itself (its exit status as the shell
    sees it, what a fresh interpreter imports or leaves running), and so does anything that starts
    servers or freezes (the embedded PostgreSQL of a missing database URL, a crashpoint), and a call
    from another thread than the main one (in-process, a command swaps process-wide state).
    ``timeout`` bounds a real process; a hang in-process meets pytest-timeout.
    """
    if (
        process
        or not env.get("PIPELINE_DATABASE_URL")
        or env.get("PIPELINE_CRASHPOINT")
        or threading.current_thread() is not threading.main_thread()
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline_assets.cli", *args],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    else:
        proc = _cli_in_process(list(args), env)
    if check and proc.returncode != 0:
        raise AssertionError(f"pipeline-assets {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def _cli_in_process(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run the CLI's root group here, in ``env`` and REPO, then put back what a command changes
    process-wide (the environment, the working directory, logging, signal handlers)."""
    import logging
    import traceback

    from click.testing import CliRunner

    from pipeline_assets.cli import main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    warnings_captured = logging._warnings_showwarning is not None  # type: ignore[attr-defined]
    # Earlier tests' Dagster instances leave SQLite connections (SQLAlchemy's NullPool) for the
    # garbage collector, which may finalize them during this command, in another thread, and
    # log the failed reset through the root logger into this command's stderr. A real CLI
    # process holds no such connection (nothing in it uses SQLAlchemy), so those records stay
    # out of the command's output here.
    pool_logger = logging.getLogger("sqlalchemy.pool")
    saved_pool_propagate = pool_logger.propagate
    pool_logger.propagate = False
    pool_sink = logging.NullHandler()  # else logging's last resort prints them to stderr anyway
    pool_logger.addHandler(pool_sink)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    try:
        result = CliRunner().invoke(main, args, catch_exceptions=True)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
        logging.captureWarnings(warnings_captured)
        pool_logger.propagate = saved_pool_propagate
        pool_logger.removeHandler(pool_sink)
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # What the interpreter prints for an uncaught exception (exit status 1).
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["pipeline-assets", *args], result.exit_code, result.stdout, stderr)


def start_cli(*args: str, env: dict) -> subprocess.Popen:
    """A CLI process in its own process group, so a test can SIGKILL the whole group."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline_assets.cli", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 120) -> str:
    """Read the process's stderr until a line containing needle (e.g. a CRASHPOINT)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if needle in line:
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"process never printed {needle!r} (exit {proc.poll()})")


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return any(p.status() != psutil.STATUS_ZOMBIE for p in _group_members(pgid))


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid:
                members.append(p)
    return members


def stop_group(proc: subprocess.Popen, first: int = signal.SIGTERM, grace: float = 60) -> int:
    """Stop a process started with ``start_new_session=True`` and its whole process group.

    ``first`` goes to the process (SIGINT: a clean shutdown it handles); once it exited (or after
    ``grace`` seconds), whatever is left of its group gets SIGTERM, then SIGKILL: a child that
    ignores SIGTERM (dagster's code server) or outlives its parent must not survive the test.
    Returns the process's exit code.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(first)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.returncode is not None and not _group_alive(proc.pid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: proc.poll() is not None and not _group_alive(proc.pid),
                timeout=20,
                interval=0.1,
                what="the process group to exit",
            )
    proc.wait(timeout=30)
    assert not _group_alive(proc.pid), f"process group {proc.pid} survived SIGKILL"
    return proc.returncode


WAIT_FIRST_INTERVAL, WAIT_MAX_INTERVAL = 0.05, 0.5


def wait_until(predicate, timeout: float = 120, interval: float | None = None, what: str = "condition"):
    """Poll until predicate() is truthy; return its value. The default deadline is generous (a
    CLI process imports for many seconds on a loaded machine): it only bounds a failure.

    ``interval`` polls at that fixed rate (a transient state to catch); without it the polls start
    20 times a second and slow down to twice a second, so a long wait costs few predicate calls
    (a query, a process scan) and a short one still returns within a tick of its condition."""
    deadline = time.monotonic() + timeout
    pause = WAIT_FIRST_INTERVAL if interval is None else interval
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(pause)
        if interval is None:
            pause = min(WAIT_MAX_INTERVAL, pause * 1.25)
    raise AssertionError(f"timed out waiting for {what}")
