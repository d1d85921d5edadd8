"""Ending the `pipeline-assets` process once its command is done, without the interpreter's teardown.

A command imports over a thousand modules (the provider SDK, the database driver, numpy); freeing
them one by one at exit costs ~0.3 CPU-seconds after the work is done and its output written.
``end`` runs what a normal exit runs that is seen outside the process (the atexit handlers:
logging's flush, multiprocessing's children, finalizers such as temporary directories'), flushes
stdout and stderr, and ends the process with the command's status (``sys.exit``'s meaning of
``code``). While another non-daemon thread runs, a normal exit (which waits for it) is taken instead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def status_of(code: str | int | None) -> int:
    """The exit status ``sys.exit(code)`` gives: None 0, an int itself, anything else printed
    on stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def end(code: str | int | None) -> NoReturn:
    """End the process with ``code``'s status after its atexit handlers, without the teardown."""
    main = threading.main_thread()
    if threading.current_thread() is not main or any(
        t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()
    ):
        sys.exit(code)
    status = status_of(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
