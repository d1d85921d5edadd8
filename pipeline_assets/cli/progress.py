"""A progress bar for `embed` and `work --until-idle`, on a terminal only; `status --watch`.

When stderr is a terminal: a rich bar on stderr with jobs done of the queue
the worker started with, jobs per second and the time left. Otherwise (a pipe,
a file, a service) nothing at all: the output is what it always was. It reads
the worker's own counters a few times a second (nothing in the worker's loop
changes); the total is the model's outstanding jobs when the worker starts.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool
    from rich.progress import Progress, ProgressColumn, Task, TaskID, Text

from pipeline_assets.jobqueue.worker import Worker

# How often the bar re-reads the worker's counters (seconds).
REFRESH_SECONDS = 0.25

# `status --watch` without a value: seconds between two refreshes.
WATCH_SECONDS = 2.0


def _rate_column() -> ProgressColumn:
    """A column of jobs per second (rich is imported only when a bar is shown)."""
    from rich.progress import ProgressColumn, Text

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("- jobs/s" if speed is None else f"{speed:,.1f} jobs/s")

    return Rate()


def _done(worker: Worker) -> int:
    r = worker.report
    return r.embedded + r.failed + r.superseded + r.refused


class WorkProgress:
    """``observe`` is handed to the worker use case; the bar follows that worker until closed."""

    def __init__(self, pool: ConnectionPool, enabled: bool) -> None:
        self._pool = pool
        self.enabled = enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress: Progress | None = None

    def observe(self, worker: Worker) -> None:
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )

        from pipeline_assets.app.metrics import outstanding_jobs

        total = outstanding_jobs(self._pool, worker.model_id)
        self._progress = progress = Progress(
            TextColumn("embedding"),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            _rate_column(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(file=sys.stderr),
            transient=False,
        )
        task = progress.add_task("embedding", total=total or None)
        progress.start()
        self._thread = threading.Thread(
            target=self._follow, args=(progress, worker, task, total), name="progress", daemon=True
        )
        self._thread.start()

    def _follow(self, progress: Progress, worker: Worker, task: TaskID, total: int) -> None:
        while True:
            stopping = self._stop.wait(REFRESH_SECONDS)
            done = _done(worker)
            progress.update(task, completed=done, total=max(total, done) or None)
            if stopping:
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._progress is not None:
            self._progress.stop()


@contextmanager
def work_progress(pool: ConnectionPool, enabled: bool | None = None) -> Iterator[WorkProgress]:
    """A WorkProgress shown only when stderr is a terminal (``enabled`` overrides)."""
    bar = WorkProgress(pool, sys.stderr.isatty() if enabled is None else enabled)
    try:
        yield bar
    finally:
        bar.close()


def watch_status(
    read: Callable[[], dict],
    lines: Callable[[dict], Iterable[str]],
    as_json: bool,
    every: float,
    count: int | None = None,
    stop_event: threading.Event | None = None,
) -> None:
    """`status --watch`: read and print every ``every`` seconds until Ctrl-C (or ``count`` times).

    On a terminal the screen is redrawn; piped, each refresh is appended (a
    timestamped block, or one JSON object per line with ``--json``).
    """
    terminal = sys.stdout.isatty()
    shown = 0
    try:
        while True:
            started = time.monotonic()
            data = read()
            now = datetime.now(UTC).isoformat(timespec="seconds")
            if as_json:
                click.echo(json.dumps({"at": now, **data}, default=str))
            else:
                if terminal:
                    click.clear()
                elif shown:
                    click.echo()
                click.echo(f"status at {now} (every {every:g} s; Ctrl-C stops)")
                for line in lines(data):
                    click.echo(line)
            shown += 1
            if count is not None and shown >= count:
                return
            remaining = max(0.0, every - (time.monotonic() - started))
            if stop_event is None:
                time.sleep(remaining)
            elif stop_event.wait(remaining):  # Ctrl-C sets it (a signal handler, not an exception mid-read)
                return
    except KeyboardInterrupt:
        return
