"""Child processes forked by multiprocessing's forkserver, not by their caller.

The forkserver is one single-threaded process per caller (started at the first child, with
``PRELOAD_MODULES`` imported), so a child never inherits a lock that another thread of a
multi-threaded caller (a Dagster run, a test runner, a pool of connections) held at the fork.
Unlike a plain forkserver process, a child never imports the caller's ``__main__``.
"""

from __future__ import annotations

import io
import os
import threading
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from multiprocessing.context import ForkServerProcess, set_spawning_popen
from typing import Any

# What the extraction server imports once, before it forks any child.
PRELOAD_MODULES = ("pipeline_assets.content.extract_preload",)


class _Popen(popen_forkserver.Popen):
    """CPython 3.11's forkserver launch (``popen_forkserver.Popen._launch``) without the caller's
    ``__main__``: a child never runs the caller's script again (which an unguarded script would
    make start children of its own), nor pays for importing it."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = {
            key: value
            for key, value in spawn.get_preparation_data(process_obj._name).items()
            if key not in ("init_main_from_name", "init_main_from_path")
        }
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        parent_w = os.dup(w)  # the child's sign that this process is alive
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class ServerProcess(ForkServerProcess):
    """A child started by the forkserver: a single-threaded process (with ``PRELOAD_MODULES``
    loaded) that forks it. A fork of the caller itself could copy a lock another of its threads
    held at that moment into the child, which would then wait on it forever."""

    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        forkserver.set_forkserver_preload(list(PRELOAD_MODULES))  # read when the server starts
        return _Popen(process_obj)


def start_server() -> None:
    """Start this process's extraction server (with ``PRELOAD_MODULES``) unless it runs already."""
    forkserver.set_forkserver_preload(list(PRELOAD_MODULES))
    forkserver.ensure_running()


def start_server_soon() -> None:
    """``start_server`` in a thread of its own: the server's start (an interpreter and the
    extraction code's imports, ~0.3 s) overlaps what the caller does before its first child."""
    threading.Thread(target=start_server, name="extraction-server-start", daemon=True).start()
