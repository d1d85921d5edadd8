"""What every command shares: the expected-error boundary, the settings read once by the
root group, a pool, a runtime, and printing as text or JSON."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NoReturn, ParamSpec, TypeVar

import click
import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app.runtime import Runtime
from pipeline_assets.content.sources import SourceError
from pipeline_assets.jobqueue.worker import BudgetExhausted, FatalProviderError, WorkerFault
from pipeline_assets.messages import one_line
from pipeline_assets.providers import ConfigError, ProviderError
from pipeline_assets.settings import Settings, SettingsError, redact_text
from pipeline_assets.store import db
from pipeline_assets.store.migrations import MigrationRefused
from pipeline_assets.store.table_source import TableSourceError

# Expected database errors, besides a lost connection (OperationalError): InternalError
# covers a read-only server or transaction (ReadOnlySqlTransaction) and an index build
# pgvector refuses; InsufficientPrivilege a role that lacks a grant.
EXPECTED = (
    db.DatabaseUnavailable,
    MigrationRefused,
    SourceError,
    ConfigError,
    SettingsError,
    FatalProviderError,
    BudgetExhausted,
    WorkerFault,
    TableSourceError,
    ProviderError,
    psycopg.OperationalError,
    psycopg.InternalError,
    psycopg.errors.InsufficientPrivilege,
    subprocess.TimeoutExpired,
    ValueError,
    OSError,
)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 1."""
    click.echo(f"error: {redact_text(one_line(message))}", err=True)
    sys.exit(1)


def expected_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn expected failures into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except EXPECTED as exc:
            fail(str(exc) or type(exc).__name__)

    return wrapper


def settings() -> Settings:
    """The Settings the root group read once from the environment."""
    return click.get_current_context().find_root().obj


@contextmanager
def pool(max_size: int = 4) -> Iterator[ConnectionPool]:
    with db.open_pool(settings().database_config(), max_size=max_size) as p:
        yield p


def runtime(model: str | None = None, *, allow_empty: bool = False) -> Runtime:
    return Runtime.build(settings(), model, allow_empty=allow_empty)


def emit(data: T, as_json: bool, text_lines: Callable[[T], Iterable[str]] | None) -> None:
    """``data`` as JSON, or as the lines ``text_lines`` makes of it (``None``: JSON only)."""
    if as_json or text_lines is None:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        for line in text_lines(data):
            click.echo(line)


def pairs(d: dict) -> list[str]:
    return [" ".join(f"{k}={v}" for k, v in d.items() if v is not None)]


# A command still running this long after SIGTERM/SIGINT writes every thread's stack to stderr
# (its log) once, naming where a stop hangs; below the deployment's 30 s grace before SIGKILL.
STOP_STACKS_AFTER_SECONDS = 20.0
# The signals that stop a worker (it hands back what it holds and exits).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A signal on which a worker writes every thread's stack to stderr at once (``kill -USR1 PID``); a
# C-level handler, so it answers even when the main thread is blocked.
STACKS_SIGNAL = signal.SIGUSR1


# The stop callback the signal watcher calls (the last ``stop_on_signals``'s): one watcher per process.
_stop_now: Callable[[], None] | None = None
_watcher_lock = threading.Lock()
_watcher: threading.Thread | None = None
_wakeup: socket.socket | None = None  # the fd's socket, kept open for the life of the process


def _watch_stop_signals() -> None:
    """Read the signal numbers Python's C-level handler writes to the wakeup fd, in a thread: a stop
    is seen even while the main thread is inside one long C call, where Python's own handler waits
    for it to return. Started once per process, from the main thread."""
    global _watcher, _wakeup
    with _watcher_lock:
        if _watcher is not None:
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread: Python's handler alone
            reader.close()
            writer.close()
            return
        _wakeup = writer
        stop_numbers = {int(sig) for sig in STOP_SIGNALS}

        def watch() -> None:
            while data := reader.recv(64):
                callback = _stop_now
                if callback is not None and stop_numbers.intersection(data):
                    callback()

        _watcher = threading.Thread(target=watch, name="stop-signals", daemon=True)
        _watcher.start()


def stop_on_signals(stacks_after: float = STOP_STACKS_AFTER_SECONDS) -> threading.Event:
    """SIGTERM/SIGINT stop claiming; the worker hands back what it holds and exits. Still
    running ``stacks_after`` seconds after the first signal, it dumps its threads' stacks;
    ``STACKS_SIGNAL`` dumps them at any time. The stop is set by Python's handler and, at once,
    by a thread reading the signal wakeup fd (``_watch_stop_signals``)."""
    global _stop_now
    stop = threading.Event()
    # Only where stderr is a file (a command run in-process by a test captures it: no dump there).
    with contextlib.suppress(AttributeError, ValueError, OSError):
        faulthandler.register(STACKS_SIGNAL, all_threads=True)

    def stop_now() -> None:
        # The handler and the watcher may both get here: arming the dump again only reschedules
        # the one timer, so the dump still comes once.
        if not stop.is_set():
            with contextlib.suppress(AttributeError, ValueError, OSError):
                faulthandler.dump_traceback_later(stacks_after, exit=False)
            stop.set()

    def on_signal(signum: int, frame: object) -> None:
        stop_now()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    _stop_now = stop_now
    _watch_stop_signals()
    # A parent may have started this process with them blocked (a mask is inherited through exec):
    # blocked, they would stay pending for ever. Unblocked here, before the worker starts its threads.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    return stop
