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
Why one child by default: docs/decisions/0001-one-extraction-child.md.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import pickle
import re
import resource
import select
import signal
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from types import TracebackType
from typing import Any

from pipeline_assets.content.extract import ExtractError
from pipeline_assets.content.server_process import ServerProcess

# Error classes of a call that did not return normally.
TIMEOUT = "timeout"                  # still running at its deadline: the child was killed
MEMORY_LIMIT = "memory_limit"        # MemoryError under the child's address-space limit
CHILD_DIED = "extract_crashed"       # the child died without answering (a crash in C code, the OOM killer)
UNEXPECTED = "extract_failed"        # any other exception of the function (a bug): one call's error

# How long a new child may take to start (the first one also starts the forkserver) and say it is ready.
CHILD_START_TIMEOUT_SECONDS = 60.0
# How long a child asked to leave may take before it is killed.
CHILD_EXIT_TIMEOUT_SECONDS = 2.0
# How much of an unexpected exception's text is kept.
MESSAGE_MAX_CHARS = 300
# Calls queued in one child's pipe at most (bounds the raw bytes held for a resend),
# enough to keep a child busy while the parent writes a batch to the database.
MAX_QUEUED_CALLS = 64
# Attempts of a call killed at its deadline or whose child died, each in a fresh child.
CALL_ATTEMPTS = 2
# How long a stuck child may take to dump its stack before it is killed, and how many of
# its innermost frames the timeout's message names.
STACK_DUMP_SECONDS = 1.0
STACK_FRAMES = 3
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


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, which a container's cpuset narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _serve(calls: Connection, answers: Connection, stack: Connection, fn: Callable[..., Any],
           memory_limit: int) -> None:
    """The child: answer calls in order until told to stop (None) or the pipe closes;
    its Python stack goes to ``stack`` on SIGUSR1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent decides when this process ends
    faulthandler.disable()  # a crash is reported by the parent, in one line
    faulthandler.register(signal.SIGUSR1, file=stack.fileno(), all_threads=False)
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


class _Child:
    """One child process, its pipes and the calls queued on it, oldest first."""

    def __init__(self) -> None:
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.calls: Connection | None = None      # parent -> child
        self.answers: Connection | None = None    # child -> parent
        self.stack: Connection | None = None      # child -> parent: its stack, on SIGUSR1
        self.window = 4096
        self.pending: deque[tuple[Any, bytes, int]] = deque()  # (tag, pickled args, attempt), oldest first
        self.queued_bytes = 0
        self.head_started = 0.0

    def has_room(self, size: int) -> bool:
        return not self.pending or (len(self.pending) < MAX_QUEUED_CALLS and self.queued_bytes + size <= self.window)

    def deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else self.head_started + timeout

    def kill(self) -> int | None:
        """Kill the process (if any) and return its exit code."""
        code = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            code = self.proc.exitcode
        for conn in (self.calls, self.answers, self.stack):
            if conn is not None:
                conn.close()
        self.proc = self.calls = self.answers = self.stack = None
        return code

    def where(self) -> str:
        """Where the running child is now: its innermost frames, or "" if it does not say
        within STACK_DUMP_SECONDS (stuck in C code that blocks signals, or gone)."""
        if self.proc is None or self.proc.pid is None or self.stack is None:
            return ""
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except OSError:
            return ""
        dump = b""
        deadline = time.monotonic() + STACK_DUMP_SECONDS
        while (left := deadline - time.monotonic()) > 0:
            # The whole dump comes in a few writes: wait for the first, then until a pause.
            readable, _, _ = select.select([self.stack.fileno()], [], [], left if not dump else min(left, 0.1))
            if not readable:
                if dump:
                    break
                continue
            chunk = os.read(self.stack.fileno(), 1 << 16)
            if not chunk:
                break
            dump += chunk
        return innermost_frames(dump.decode("utf-8", "replace"))


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def innermost_frames(dump: str, frames: int = STACK_FRAMES) -> str:
    """``faulthandler``'s dump (most recent call first) as ``fn (dir/file.py:N) < caller (...)``."""
    found = [f"{name} ({'/'.join(path.split('/')[-2:])}:{line})" for path, line, name in _FRAME.findall(dump)]
    return " < ".join(found[:frames])


class Sandbox:
    """Calls ``fn(*args)`` in up to ``processes`` child processes (0: one per usable core).
    ``submit`` queues a call (False when every child's queue is full: ``take`` first);
    ``take`` returns ``(tag, outcome)`` of the first call answered, the outcome being its
    value or an ``ExtractError`` (the function's own, or TIMEOUT / MEMORY_LIMIT /
    CHILD_DIED / UNEXPECTED). With one process, calls are answered in the order submitted."""

    def __init__(self, fn: Callable[..., Any], *, timeout: float, memory_limit: int, processes: int = 1) -> None:
        self.fn = fn
        self.timeout = timeout if timeout > 0 else None
        self.memory_limit = memory_limit
        self.starts = 0  # children started
        self.resent = 0  # calls sent again after a timeout or a dead child
        self._children = [_Child() for _ in range(processes if processes > 0 else usable_cores())]

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def pending(self) -> int:
        return sum(len(c.pending) for c in self._children)

    @property
    def pids(self) -> list[int]:
        """Process ids of the running children."""
        return [c.proc.pid for c in self._children if c.proc is not None and c.proc.pid is not None]

    # -- the children ---------------------------------------------------------------------
    def _start(self, child: _Child) -> None:
        calls_r, calls_w = multiprocessing.Pipe(duplex=False)
        answers_r, answers_w = multiprocessing.Pipe(duplex=False)
        stack_r, stack_w = multiprocessing.Pipe(duplex=False)
        # The child gets its own ends only (the server passes exactly these): a copy of a
        # parent's end would keep its pipe open after the parent died.
        proc = ServerProcess(target=_serve, args=(calls_r, answers_w, stack_w, self.fn, self.memory_limit),
                           daemon=True, name="pipeline-extract")
        proc.start()
        for end in (calls_r, answers_w, stack_w):
            end.close()
        child.proc, child.calls, child.answers, child.stack = proc, calls_w, answers_r, stack_r
        child.window = _pipe_capacity(calls_w) // 2
        _pipe_capacity(answers_r)  # room for answers while the parent is busy elsewhere
        self.starts += 1
        if not answers_r.poll(CHILD_START_TIMEOUT_SECONDS):
            child.kill()
            raise RuntimeError(f"the extraction process did not start within {CHILD_START_TIMEOUT_SECONDS:g} s")
        answers_r.recv()

    @staticmethod
    def _pipe(conn: Connection | None) -> Connection:
        """A pipe of a running child (the callers started it)."""
        if conn is None:
            raise RuntimeError("the extraction child is not running")
        return conn

    def _send(self, child: _Child, data: bytes) -> None:
        if child.proc is None:
            self._start(child)
        if not child.pending:
            child.head_started = time.monotonic()
        self._pipe(child.calls).send_bytes(data)

    def _replace(self, child: _Child, first: tuple[Any, bytes, int] | None = None) -> int | None:
        """Kill the child; send ``first`` (a call sent again) and then the calls still queued
        on it to a new one. Returns the old exit code."""
        code = child.kill()
        queued = ([first] if first else []) + list(child.pending)
        child.pending.clear()
        child.queued_bytes = 0
        for tag, data, attempt in queued:
            self._send(child, data)
            child.pending.append((tag, data, attempt))
            child.queued_bytes += len(data)
        return code

    def _choose(self, size: int) -> _Child | None:
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
            self._replace(child)
            self._send(child, data)
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
            ready = wait_any([self._pipe(c.answers) for c in busy], wait)
            if ready:
                # The child whose head call has waited longest, of those that answered.
                outcome = self._answer(min((c for c in busy if c.answers in ready), key=lambda c: c.head_started))
            else:
                now = time.monotonic()
                late = [c for c in busy if (d := c.deadline(self.timeout)) is not None and d <= now]
                outcome = self._answer(late[0]) if late else None
            if outcome is not None:
                return outcome

    def _answer(self, child: _Child) -> tuple[Any, Any] | None:
        """The outcome of ``child``'s oldest call: its answer, or its timeout if none is there
        (None: the call was sent again, to a fresh child)."""
        tag, data, attempt = child.pending[0]
        try:
            answers = self._pipe(child.answers)
            answered = answers.poll(0)
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
                return tag, ExtractError(TIMEOUT, f"extract and chunk took longer than {self.timeout:g} s"
                                                  f"{tried}{stuck}")
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
