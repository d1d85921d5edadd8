"""A worker in a thread that claims only some documents' jobs (or the model's whole queue),
until told to stop: what ``vector_wait`` runs in process while it waits."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from psycopg_pool import ConnectionPool

from pipeline_assets.app.runtime import Runtime
from pipeline_assets.jobqueue.worker import Worker, WorkerReport
from pipeline_assets.store import db


class ScopedWorker:
    """A worker in a thread that claims only some documents' jobs, until told to stop."""

    def __init__(self, rt: Runtime, pool: ConnectionPool, doc_pks: Sequence[int] | None, poll_seconds: float | None):
        config = rt.settings.worker_config(
            until_idle=False,
            scope=None if doc_pks is None else tuple(doc_pks),
            build_index=False,
            poll_seconds=poll_seconds or None,
        )
        self._stop_event = threading.Event()
        self._worker = Worker(db.pool_url(pool), rt.provider, config, stop_event=self._stop_event)
        self._report: WorkerReport | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="scoped-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._report = self._worker.run()
        except BaseException as exc:  # BudgetExhausted, FatalProviderError, WorkerFault, ...: raised by finish()
            self._error = exc

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def finish(self) -> tuple[WorkerReport, BaseException | None]:
        """Stop it (it hands back what it holds); its report and the error it stopped on, if any."""
        self._stop_event.set()
        self._thread.join()
        return self._report or self._worker.report, self._error
