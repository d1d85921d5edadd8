"""A worker's work beside its main loop, each on a connection of its own, an error a logged
warning: the chunks' missing text-search vectors, computed from the worker's first beat with
work queued (beside the sending, so the fill is not left for after the last answer) and again
when the queue drains; and, once drained, the model's missing vector index (in bulk: far cheaper
than per insert during a backfill; ``registry.background_build``) and, beside it, the embed stage
rows of what the run touched (``stage_runs.BackgroundStages``, when given the run's start). When the build starts is
``running_ingests.index_build_decision``'s: not while an ingest runs and, unless `--until-idle`,
not before the queue has stayed empty for ``index_quiet_seconds``. The worker cancels both when
it stops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime

import psycopg

from pipeline_assets.jobqueue import running_ingests
from pipeline_assets.jobqueue.worker_config import WorkerConfig
from pipeline_assets.registry.background_build import BackgroundBuild
from pipeline_assets.store import stage_runs, text_search

log = logging.getLogger("pipeline_assets.jobqueue.worker")  # the worker's log


class DrainWork:
    """One worker's text-search fill and index build; ``on_done`` is told when either ends."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection],
        model_id: str,
        config: WorkerConfig,
        *,
        on_done: Callable[[], object],
        stages_since: datetime | None = None,
    ) -> None:
        self._connect = connect
        self._stages_since = stages_since
        self.model_id = model_id
        self.config = config
        self._on_done = on_done
        self.index_build: BackgroundBuild | None = None  # started when the queue drains
        self.text_fill: text_search.BackgroundFill | None = None  # chunks' text-search vectors
        # The embed stage rows of what the run touched since ``stages_since``, beside the build.
        self.stages: stage_runs.BackgroundStages | None = None
        self._drained_since: float | None = None  # the queue empty at every beat since (monotonic)
        self._deferred_for_ingest = False  # the build was put off while an ingest runs (logged once)

    def busy(self) -> None:
        """The queue holds work: the quiet time before a build starts over. The worker's first
        fill starts now, beside the sending (chunks an ingest left without their text-search
        vectors: ``embed``'s, or a concurrent ingest's batches already committed)."""
        self._drained_since = None
        if self.text_fill is None and self.config.build_index:
            self._start_fill()

    def drained(self, ingest_running: Callable[[], bool], dimension: int | None) -> bool:
        """The queue is empty: start the build and the fill when due. Returns whether `--until-idle`
        may exit (the build is over, or put off: an ingest is running, which would insert into a
        fresh index row by row)."""
        if not self.config.build_index or not dimension:
            return True
        build, fill = self.index_build, self.text_fill
        if build is not None and not build.retry_due(time.monotonic()):
            return build.done and (fill is None or fill.done) and (self.stages is None or self.stages.done)
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
        if fill is None or fill.done:  # what is left (chunks committed since the last pass), beside the build
            fill = self._start_fill()
        if self._stages_since is not None and self.stages is None:
            self.stages = stage_runs.BackgroundStages(
                self._connect, self.model_id, self._stages_since, on_done=self._on_done
            ).start()
        return build.done and fill.done and (self.stages is None or self.stages.done)

    def _start_fill(self) -> text_search.BackgroundFill:
        self.text_fill = fill = text_search.BackgroundFill(self._connect, on_done=self._on_done).start()
        return fill
