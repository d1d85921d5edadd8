"""One extraction child: the loop it runs (``serve``) and the parent's handle on it (``Child``:
its process, its pipes, the calls queued on it, and where it is stuck when it does not answer)."""

from __future__ import annotations

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
from typing import Any

from pipeline_assets.content.extract import ExtractError
from pipeline_assets.content.server_process import ServerProcess

# Error classes of a call that did not return normally.
TIMEOUT = "timeout"  # still running at its deadline: the child was killed
MEMORY_LIMIT = "memory_limit"  # MemoryError under the child's address-space limit
CHILD_DIED = "extract_crashed"  # the child died without answering (a crash in C code, the OOM killer)
UNEXPECTED = "extract_failed"  # any other exception of the function (a bug): one call's error

# How long a new child may take to start (the first one also starts the forkserver) and say it is ready.
CHILD_START_TIMEOUT_SECONDS = 60.0
# Calls queued in one child's pipe at most (bounds the raw bytes held for a resend),
# enough to keep a child busy while the parent writes a batch to the database.
MAX_QUEUED_CALLS = 64
# How much of an unexpected exception's text is kept.
MESSAGE_MAX_CHARS = 300
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


def serve(calls: Connection, answers: Connection, stack: Connection, fn: Callable[..., Any], memory_limit: int) -> None:
    """The child: answer calls in order until told to stop (None) or the pipe closes;
    its Python stack goes to ``stack`` on SIGUSR1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
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


class Child:
    """One child process, its pipes and the calls queued on it, oldest first."""

    def __init__(self) -> None:
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.calls: Connection | None = None  # parent -> child
        self.answers: Connection | None = None  # child -> parent
        self.stack: Connection | None = None  # child -> parent: its stack, on SIGUSR1
        self.window = 4096
        self.pending: deque[tuple[Any, bytes, int]] = deque()  # (tag, pickled args, attempt), oldest first
        self.queued_bytes = 0
        self.head_started = 0.0

    def start(self, fn: Callable[..., Any], memory_limit: int) -> None:
        """Start the process (``serve``) and wait until it says it is ready."""
        calls_r, calls_w = multiprocessing.Pipe(duplex=False)
        answers_r, answers_w = multiprocessing.Pipe(duplex=False)
        stack_r, stack_w = multiprocessing.Pipe(duplex=False)
        # The child gets its own ends only (the server passes exactly these): a copy of a
        # parent's end would keep its pipe open after the parent died.
        proc = ServerProcess(
            target=serve, args=(calls_r, answers_w, stack_w, fn, memory_limit), daemon=True, name="pipeline-extract"
        )
        proc.start()
        for end in (calls_r, answers_w, stack_w):
            end.close()
        self.proc, self.calls, self.answers, self.stack = proc, calls_w, answers_r, stack_r
        self.window = _pipe_capacity(calls_w) // 2
        _pipe_capacity(answers_r)  # room for answers while the parent is busy elsewhere
        if not answers_r.poll(CHILD_START_TIMEOUT_SECONDS):
            self.kill()
            raise RuntimeError(f"the extraction process did not start within {CHILD_START_TIMEOUT_SECONDS:g} s")
        answers_r.recv()

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
