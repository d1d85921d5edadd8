"""Run a function in a child process that is killed at its deadline, under a memory limit.

Parsing and chunking one document run here (``process.Extractor``): a parser
stuck in C code, one that swallows exceptions, or one whose input inflates to
gigabytes is stopped by the kernel, not by the parser's cooperation, and from
any thread (a Dagster run, a sensor), where a SIGALRM could not.

One long-lived child serves the calls of one ingest in order, so the cost is one
fork per ingest plus a pipe round trip per document. The child is forked
(copy-on-write: the loaded modules and the tokenizer come for free); it only
computes and answers on its pipes, and leaves with ``os._exit`` (via
multiprocessing), so it never touches the parent's connections or threads.

Calls are pipelined: ``submit`` queues a call while the child works on earlier
ones (the parent reads and checksums the next files meanwhile), as long as the
queued calls fit in half the pipe's buffer, so a send never blocks on a busy or
stuck child. ``take`` returns the oldest call's outcome. Each call's deadline
starts when the parent has the previous answer (when the child is free for it);
past it the child is killed (SIGKILL), the call fails with ``timeout``, and the
calls queued behind it are sent again to a new child.
Memory: the child's address space may grow by ``memory_limit`` bytes past what it
inherited (RLIMIT_AS); an allocation beyond it raises MemoryError in the child.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import resource
import signal
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from pipeline_assets.content.extract import ExtractError

# Error classes of a call that did not return normally.
TIMEOUT = "timeout"                  # still running at its deadline: the child was killed
MEMORY_LIMIT = "memory_limit"        # MemoryError under the child's address-space limit
CHILD_DIED = "extract_crashed"       # the child died without answering (a crash in C code, the OOM killer)
UNEXPECTED = "extract_failed"        # any other exception of the function (a bug): one call's error

# How long a new child may take to fork and say it is ready.
CHILD_START_TIMEOUT_SECONDS = 60.0
# How long a child asked to leave may take before it is killed.
CHILD_EXIT_TIMEOUT_SECONDS = 2.0
# How much of an unexpected exception's text is kept.
MESSAGE_MAX_CHARS = 300
# Calls queued in the child's pipe at most (bounds the raw bytes held for a resend).
MAX_QUEUED_CALLS = 16
# Pipe buffer asked for (Linux allows up to /proc/sys/fs/pipe-max-size, 1 MiB by
# default); half of what is granted may be queued, so a send never blocks.
PIPE_BUFFER_BYTES = 1 << 20


def _address_space() -> int | None:
    """Bytes of virtual address space this process uses now (None where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _pipe_capacity(conn: Connection) -> int:
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BUFFER_BYTES)
        return fcntl.fcntl(conn.fileno(), fcntl.F_GETPIPE_SZ)
    except (ImportError, AttributeError, OSError):
        return 4096  # POSIX guarantees at least this much


def _serve(calls: Connection, answers: Connection, parent_ends: tuple[Connection, ...],
           fn: Callable[..., Any], memory_limit: int) -> None:
    """The child: answer calls in order until told to stop (None) or the pipe closes."""
    for conn in parent_ends:
        conn.close()  # else the child's own copy would keep its pipe open after the parent died
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent decides when this process ends
    faulthandler.disable()  # a crash is reported by the parent, in one line
    used = _address_space()
    if memory_limit > 0 and used is not None:
        limit = used + memory_limit
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    answers.send(("ready",))
    while True:
        try:
            args = pickle.loads(calls.recv_bytes())
        except (EOFError, OSError):
            return
        if args is None:
            return
        try:
            answers.send(("ok", fn(*args)))
        except ExtractError as exc:
            answers.send(("error", exc.error_class, exc.message))
        except MemoryError:
            answers.send(("error", MEMORY_LIMIT, f"needed more than {memory_limit} bytes of memory"))
            return  # leave: the memory is given back with the process; queued calls are resent
        except Exception as exc:  # a bug in a parser: that call's error, not the caller's
            answers.send(("error", UNEXPECTED, f"{type(exc).__name__}: {exc}"[:MESSAGE_MAX_CHARS]))


class Sandbox:
    """Calls ``fn(*args)`` in a child process, in order. ``submit`` queues a call (False
    when the queue is full: ``take`` first); ``take`` returns ``(tag, outcome)`` of the
    oldest call, the outcome being its value or an ``ExtractError`` (the function's own,
    or TIMEOUT / MEMORY_LIMIT / CHILD_DIED / UNEXPECTED)."""

    def __init__(self, fn: Callable[..., Any], *, timeout: float, memory_limit: int) -> None:
        self.fn = fn
        self.timeout = timeout if timeout > 0 else None
        self.memory_limit = memory_limit
        self.starts = 0  # children started
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._calls: Connection | None = None      # parent -> child
        self._answers: Connection | None = None    # child -> parent
        self._window = 4096
        self._pending: deque[tuple[Any, bytes]] = deque()  # (tag, pickled args), oldest first
        self._queued_bytes = 0
        self._head_started = 0.0

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- the child ------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = multiprocessing.get_context("fork")
        calls_r, calls_w = ctx.Pipe(duplex=False)
        answers_r, answers_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_serve, args=(calls_r, answers_w, (calls_w, answers_r), self.fn, self.memory_limit),
                           daemon=True, name="pipeline-extract")
        proc.start()
        calls_r.close()
        answers_w.close()
        self._proc, self._calls, self._answers = proc, calls_w, answers_r
        self._window = _pipe_capacity(calls_w) // 2
        self.starts += 1
        if not answers_r.poll(CHILD_START_TIMEOUT_SECONDS):
            self._kill()
            raise RuntimeError(f"the extraction process did not start within {CHILD_START_TIMEOUT_SECONDS:g} s")
        answers_r.recv()

    def _kill(self) -> int | None:
        """Kill the child (if any) and return its exit code."""
        code = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            code = self._proc.exitcode
        for conn in (self._calls, self._answers):
            if conn is not None:
                conn.close()
        self._proc = self._calls = self._answers = None
        return code

    @staticmethod
    def _pipe(conn: Connection | None) -> Connection:
        """A pipe of the running child (the callers started it)."""
        if conn is None:
            raise RuntimeError("the extraction child is not running")
        return conn

    def _send(self, data: bytes) -> None:
        if self._proc is None:
            self._start()
        if not self._pending:
            self._head_started = time.monotonic()
        self._pipe(self._calls).send_bytes(data)

    def _replace_child(self) -> int | None:
        """Kill the child; send the calls still queued to a new one. Returns the old exit code."""
        code = self._kill()
        queued = list(self._pending)
        self._pending.clear()
        self._queued_bytes = 0
        for tag, data in queued:
            self._send(data)
            self._pending.append((tag, data))
            self._queued_bytes += len(data)
        return code

    # -- calls ----------------------------------------------------------------------------------
    def submit(self, tag: Any, *args: Any) -> bool:
        """Queue ``fn(*args)``; False (nothing sent) when the queue is full."""
        data = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        if self._pending and (len(self._pending) >= MAX_QUEUED_CALLS
                              or self._queued_bytes + len(data) > self._window):
            return False
        try:
            self._send(data)
        except OSError:  # the child died (the OOM killer): what was queued, and this, to a new one
            self._replace_child()
            self._send(data)
        self._pending.append((tag, data))
        self._queued_bytes += len(data)
        return True

    def take(self) -> tuple[Any, Any]:
        """Wait for the oldest call: ``(tag, value)`` or ``(tag, ExtractError)``."""
        tag, data = self._pending[0]
        wait = None if self.timeout is None else max(0.0, self._head_started + self.timeout - time.monotonic())
        try:
            answers = self._pipe(self._answers)
            answered = answers.poll(wait)
            answer = answers.recv() if answered else None
        except (EOFError, OSError):
            answered, answer = True, None
        self._pending.popleft()
        self._queued_bytes -= len(data)
        if answer is None:
            code = self._replace_child()
            if not answered:
                return tag, ExtractError(TIMEOUT, f"extract and chunk took longer than {self.timeout:g} s")
            hint = " (SIGKILL: the OOM killer?)" if code == -signal.SIGKILL else ""
            return tag, ExtractError(CHILD_DIED, f"the extraction process died, exit code {code}{hint}")
        self._head_started = time.monotonic()  # the child is free for the next call now
        if answer[0] == "ok":
            return tag, answer[1]
        if answer[1] == MEMORY_LIMIT:
            self._replace_child()  # it left; what was queued behind goes to a new child
        return tag, ExtractError(answer[1], answer[2])

    def call(self, *args: Any) -> Any:
        """One call, alone: its value, or its ExtractError raised."""
        while self._pending:
            self.take()
        self.submit(None, *args)
        _, outcome = self.take()
        if isinstance(outcome, ExtractError):
            raise outcome
        return outcome

    def close(self) -> None:
        """Ask the child to leave; kill it if it does not."""
        if self._proc is None:
            return
        try:
            self._pipe(self._calls).send_bytes(pickle.dumps(None))
            self._proc.join(CHILD_EXIT_TIMEOUT_SECONDS)
        except OSError:
            pass
        self._kill()
