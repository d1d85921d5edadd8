"""Misbehaving code for the extraction child, importable there by name (the child is forked by a
forkserver, so a test's monkeypatch of the parent does not reach it)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from pipeline_assets.content.chunking import Chunk, Chunker

# Text of the document the poison chunker misbehaves on.
POISON_TEXT = "this one makes the parser misbehave"


def _stall() -> None:
    time.sleep(300)  # a parser stuck on a pathological input


def _stall_in_c() -> None:
    # One C call that never returns to the interpreter: a signal handler cannot run inside it.
    sum(range(10**11))


def _swallow() -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # a parser's blanket handler eats whatever a timeout raises
            time.sleep(0.05)


def _inflate() -> None:
    blob = bytearray(1 << 30)  # a 1 GiB parse tree, say
    blob[-1] = 1


def _crash() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)  # a crash in a C extension


def _bug() -> None:
    raise KeyError("a parser bug")


BEHAVIOURS = {
    "stall": _stall,
    "stall_in_c": _stall_in_c,
    "swallow": _swallow,
    "inflate": _inflate,
    "crash": _crash,
    "bug": _bug,
}


class PoisonChunker(Chunker):
    """A chunker that misbehaves (``BEHAVIOURS[behaviour]``) on the poison document only."""

    def __init__(self, behaviour: str) -> None:
        super().__init__()
        self.behaviour = behaviour

    def chunk(self, text: str) -> list[Chunk]:
        if POISON_TEXT in text:
            BEHAVIOURS[self.behaviour]()
        return super().chunk(text)


# Held by a thread of the parent in a test: a child forked from the parent itself would start with
# it held, by a thread that does not exist there.
PARENT_LOCK = threading.Lock()


def under_the_parents_lock(value: object) -> object:
    with PARENT_LOCK:
        return value


class RendezvousChunker(Chunker):
    """A chunker whose first call in each process waits (up to ``wait_seconds``) until ``peers``
    processes have called it, each leaving a file named by its pid in ``directory``: a document
    chunked while no other child runs at the same time fails (``extract_failed``)."""

    def __init__(self, directory: str, peers: int = 2, wait_seconds: float = 20.0) -> None:
        super().__init__()
        self.directory, self.peers, self.wait_seconds = directory, peers, wait_seconds

    def chunk(self, text: str) -> list[Chunk]:
        open(os.path.join(self.directory, str(os.getpid())), "w").close()
        deadline = time.monotonic() + self.wait_seconds
        while len(os.listdir(self.directory)) < self.peers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no peer chunked at the same time within {self.wait_seconds:g} s")
            time.sleep(0.01)
        return super().chunk(text)
