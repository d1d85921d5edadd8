"""Run a function in child processes that are killed at their deadline, under a memory limit.

A bounded pool of long-lived children (``processes``), forked by a forkserver rather than by the
caller (``server_process``), serves one ingest's calls; a child only computes and answers on its
pipes. ``fn`` and the calls' arguments must be picklable (a module-level function, a partial of one).
``submit`` queues a call on the least busy child (at most ``MAX_QUEUED_CALLS``, within half its
pipe's buffer, so a send never blocks); ``take`` returns the first answer of any child. A call's
deadline starts when its child is free for it; past it the child is SIGKILLed, the call fails with
``timeout`` (naming where the child was stuck) and the calls behind it go to a new child. A call
killed or whose child died is tried once more in a fresh child (``CALL_ATTEMPTS``). A child's
address space may grow by ``memory_limit`` bytes (RLIMIT_AS): beyond it, MemoryError in the child.
How many an ingest uses: docs/decisions/0001-one-extraction-child.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import select
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from pipeline_assets.content.extract import ExtractError
from pipeline_assets.content.sandbox_child import CHILD_DIED, MEMORY_LIMIT, TIMEOUT, Child

# How long a child asked to leave may take before it is killed.
CHILD_EXIT_TIMEOUT_SECONDS = 2.0
# Attempts of a call killed at its deadline or whose child died, each in a fresh child.
CALL_ATTEMPTS = 2


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, which a container's cpuset narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _readable(conns: list[Connection], timeout: float | None) -> list[Connection]:
    """Those of ``conns`` that can be read (data, or the writer gone) within ``timeout`` seconds
    (None: no limit): one poll(2), where ``multiprocessing.connection.wait`` builds a selector
    per call (about as much CPU as a small document's whole round trip to its child)."""
    poller = select.poll()
    by_fd: dict[int, Connection] = {}
    for conn in conns:
        by_fd[conn.fileno()] = conn
        poller.register(conn.fileno(), select.POLLIN)
    events = poller.poll(None if timeout is None else math.ceil(timeout * 1000))
    return [by_fd[fd] for fd, _ in events]


class Sandbox:
    """Calls ``fn(*args)`` in up to ``processes`` child processes (0: one per usable core).
    ``submit`` queues a call (False when every child's queue is full: ``take`` first);
    ``take`` returns ``(tag, outcome)`` of the first call answered, the outcome being its
    value or an ``ExtractError`` (the function's own, or ``sandbox_child``'s TIMEOUT,
    MEMORY_LIMIT, CHILD_DIED, UNEXPECTED). With one process, calls are answered in the order submitted."""

    def __init__(self, fn: Callable[..., Any], *, timeout: float, memory_limit: int, processes: int = 1) -> None:
        self.fn = fn
        self.timeout = timeout if timeout > 0 else None
        self.memory_limit = memory_limit
        self.starts = 0  # children started
        self.resent = 0  # calls sent again after a timeout or a dead child
        self._children = [Child() for _ in range(processes if processes > 0 else usable_cores())]

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @property
    def pending(self) -> int:
        return sum(len(c.pending) for c in self._children)

    @property
    def pids(self) -> list[int]:
        """Process ids of the running children."""
        return [c.proc.pid for c in self._children if c.proc is not None and c.proc.pid is not None]

    # -- the children ---------------------------------------------------------------------
    def _start(self, child: Child) -> None:
        child.start(self.fn, self.memory_limit)
        self.starts += 1

    @staticmethod
    def _pipe(conn: Connection | None) -> Connection:
        """A pipe of a running child (the callers started it)."""
        if conn is None:
            raise RuntimeError("the extraction child is not running")
        return conn

    def _send(self, child: Child, data: bytes) -> None:
        if child.proc is None:
            self._start(child)
        if not child.pending:
            child.head_started = time.monotonic()
        self._pipe(child.calls).send_bytes(data)

    def _replace(self, child: Child, first: tuple[Any, bytes, int] | None = None) -> int | None:
        """Kill the child; send ``first`` (a call sent again) and then the calls still queued
        on it to a new one. Returns the old exit code. If the new one dies before all are
        sent (the call sent again crashed it at once), the rest stay queued unsent: ``take``
        sees it dead, and they go to the next child with the calls before them."""
        code = child.kill()
        queued = ([first] if first else []) + list(child.pending)
        child.pending.clear()
        child.queued_bytes = 0
        alive = True
        for tag, data, attempt in queued:
            if alive:
                try:
                    self._send(child, data)
                except OSError:  # its reader is gone: the new child died already
                    alive = False
            child.pending.append((tag, data, attempt))
            child.queued_bytes += len(data)
        return code

    def _choose(self, size: int) -> Child | None:
        """An idle running child, else a child not started yet, else the least busy one with room."""
        running = [c for c in self._children if c.proc is not None]
        idle = [c for c in running if not c.pending]
        if idle:
            return idle[0]
        unstarted = [c for c in self._children if c.proc is None and not c.pending]
        if unstarted:
            return unstarted[0]
        roomy = [c for c in self._children if c.has_room(size)]
        return min(roomy, key=lambda c: len(c.pending)) if roomy else None

    # -- calls ----------------------------------------------------------------------------------
    def submit(self, tag: Any, *args: Any) -> bool:
        """Queue ``fn(*args)``; False (nothing sent) when every child's queue is full."""
        data = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        child = self._choose(len(data))
        if child is None:
            return False
        try:
            self._send(child, data)
        except OSError:  # the child died (the OOM killer): what was queued, and this, to a new one
            child.pending.append((tag, data, 1))
            child.queued_bytes += len(data)
            self._replace(child)
            return True
        child.pending.append((tag, data, 1))
        child.queued_bytes += len(data)
        return True

    def take(self) -> tuple[Any, Any]:
        """Wait for the first call answered (or past its deadline) on any child:
        ``(tag, value)`` or ``(tag, ExtractError)``."""
        if not self.pending:
            raise RuntimeError("no call is pending")
        while True:
            busy = [c for c in self._children if c.pending]
            deadlines = [d for d in (c.deadline(self.timeout) for c in busy) if d is not None]
            wait = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            ready = _readable([self._pipe(c.answers) for c in busy], wait)
            if ready:
                # The child whose head call has waited longest, of those that answered.
                child = min((c for c in busy if c.answers in ready), key=lambda c: c.head_started)
                outcome = self._answer(child, readable=True)
            else:
                now = time.monotonic()
                late = [c for c in busy if (d := c.deadline(self.timeout)) is not None and d <= now]
                outcome = self._answer(late[0]) if late else None
            if outcome is not None:
                return outcome

    def _answer(self, child: Child, *, readable: bool = False) -> tuple[Any, Any] | None:
        """The outcome of ``child``'s oldest call: its answer, or its timeout if none is there
        (None: the call was sent again, to a fresh child). ``readable``: its pipe was just seen
        readable (an answer, or the end of a child that died)."""
        tag, data, attempt = child.pending[0]
        try:
            answers = self._pipe(child.answers)
            answered = readable or answers.poll(0)
            answer = answers.recv() if answered else None
        except (EOFError, OSError):
            answered, answer = True, None
        child.pending.popleft()
        child.queued_bytes -= len(data)
        if answer is None:
            where = "" if answered else child.where()
            again = (tag, data, attempt + 1) if attempt < CALL_ATTEMPTS else None
            code = self._replace(child, first=again)
            if again:
                self.resent += 1
                return None
            tried = f" ({attempt} times, each in a fresh process)" if attempt > 1 else ""
            if not answered:
                stuck = f"; stuck in {where}" if where else ""
                return tag, ExtractError(
                    TIMEOUT, f"extract and chunk took longer than {self.timeout:g} s{tried}{stuck}"
                )
            hint = " (SIGKILL: the OOM killer?)" if code == -signal.SIGKILL else ""
            return tag, ExtractError(CHILD_DIED, f"the extraction process died{tried}, exit code {code}{hint}")
        child.head_started = time.monotonic()  # the child is free for its next call now
        if answer[0] == "ok":
            return tag, answer[1]
        if answer[1] == MEMORY_LIMIT:
            self._replace(child)  # it left; what was queued behind goes to a new child
        return tag, ExtractError(answer[1], answer[2])

    def call(self, *args: Any) -> Any:
        """One call, alone: its value, or its ExtractError raised."""
        while self.pending:
            self.take()
        self.submit(None, *args)
        _, outcome = self.take()
        if isinstance(outcome, ExtractError):
            raise outcome
        return outcome

    def close(self) -> None:
        """Ask every child to leave; kill those that do not."""
        for child in self._children:
            if child.proc is None:
                continue
            with contextlib.suppress(OSError):
                self._pipe(child.calls).send_bytes(pickle.dumps(None))
        for child in self._children:
            if child.proc is not None:
                child.proc.join(CHILD_EXIT_TIMEOUT_SECONDS)
                child.kill()
