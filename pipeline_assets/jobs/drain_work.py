"""What a worker does once its queue has drained: build the model's missing vector index (in
bulk: far cheaper than per insert during a backfill) and compute the chunks' missing text-search
vectors beside it, each on a connection of its own beside the worker's main loop
(``registry.background_build``, ``text_search``); an error is a logged warning. When is
``running_ingests.index_build_decision``'s: no build while an ingest runs and, unless
`--until-idle`, before the queue has stayed empty for ``index_quiet_seconds``. The worker
cancels both when it stops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import psycopg

from pipeline_assets.jobs import running_ingests
from pipeline_assets.jobs.worker_config import WorkerConfig
from pipeline_assets.registry.background_build import BackgroundBuild
from pipeline_assets.store import text_search

log = logging.getLogger("pipeline_assets.jobs.worker")  # the worker's log


class DrainWork:
    """One worker's index build and text-search fill; ``on_done`` is told when either ends."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection],
        model_id: str,
        config: WorkerConfig,
        *,
        on_done: Callable[[], object],
    ) -> None:
        self._connect = connect
        self.model_id = model_id
        self.config = config
        self._on_done = on_done
        self.index_build: BackgroundBuild | None = None  # started when the queue drains
        self.text_fill: text_search.BackgroundFill | None = None  # beside it: chunks' text-search vectors
        self._drained_since: float | None = None  # the queue empty at every beat since (monotonic)
        self._deferred_for_ingest = False  # the build was put off while an ingest runs (logged once)

    def busy(self) -> None:
        """The queue holds work again: the quiet time before a build starts over."""
        self._drained_since = None

    def drained(self, ingest_running: Callable[[], bool], dimension: int | None) -> bool:
        """The queue is empty: start the build and the fill when due. Returns whether `--until-idle`
        may exit (the build is over, or put off: an ingest is running, which would insert into a
        fresh index row by row)."""
        if not self.config.build_index or not dimension:
            return True
        build, fill = self.index_build, self.text_fill
        if build is not None and not build.retry_due(time.monotonic()):
            return build.done and (fill is None or fill.done)
        now = time.monotonic()
        if self._drained_since is None:
            self._drained_since = now
        decision = running_ingests.index_build_decision(
            ingest_running,
            drained_for=now - self._drained_since,
            quiet_seconds=0.0 if self.config.until_idle else self.config.index_quiet_seconds,
        )
        if decision == running_ingests.WAIT:
            return False
        if decision == running_ingests.PUT_OFF:
            if not self._deferred_for_ingest:
                log.info("%s", running_ingests.put_off_line(self.model_id))
                self._deferred_for_ingest = True
            return True
        self.index_build = build = BackgroundBuild(
            self._connect,
            self.model_id,
            dimension,
            on_done=self._on_done,
            memory_cap=self.config.index_build_memory,
            session=self.config.prepare,
        ).start()
        if fill is None:  # chunks an ingest left without their text-search vectors, on another connection
            self.text_fill = fill = text_search.BackgroundFill(self._connect, on_done=self._on_done).start()
        return build.done and fill.done
