"""A worker's build of a model's vector index (``vector_index.build``) on a connection of its
own, in a thread beside the worker's main loop, cancelled when the worker stops (it leaves an
INVALID index the next build replaces). A build that left no usable index is tried again after
``INDEX_RETRY_SECONDS``; its error is a logged warning, never the worker's fault.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import psycopg

from pipeline_assets.messages import one_line
from pipeline_assets.registry.registry_config import DEFAULT_INDEX_BUILD_MEMORY
from pipeline_assets.registry.vector_index import EXACT, MISSING, READY, IndexBuildError, IndexNotOwned, build
from pipeline_assets.store.background import BackgroundWork

log = logging.getLogger("pipeline_assets.registry.vector_index")  # the index's log

# A long-running worker whose build failed (or was left to another builder) looks again after this long.
INDEX_RETRY_SECONDS = 600.0


class BackgroundBuild(BackgroundWork):
    """A worker's build: its own connection, a thread, cancelled when the worker stops (it
    leaves an INVALID index the next build replaces).

    The worker's main loop keeps rescuing leases and watching for stop signals
    while the index builds; completions go on committing (CONCURRENTLY).
    """

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection],
        model_id: str,
        dimension: int,
        *,
        on_done: Callable[[], object] | None = None,
        memory_cap: int = DEFAULT_INDEX_BUILD_MEMORY,
        session: bool = True,
    ) -> None:
        super().__init__(connect, name="index-build", on_done=on_done)  # told when the build is over
        self._memory_cap = memory_cap
        self._session = session
        self.model_id = model_id
        self.dimension = dimension
        self.outcome: str | None = None  # a state, once the build is over
        self.error: str | None = None  # the one-line error of a failed build

    def retry_due(self, now: float) -> bool:
        """Whether a long-running worker should try again (the last build did not leave a usable index)."""
        return (
            self.finished_at is not None
            and self.outcome not in (READY, EXACT)
            and now - self.finished_at >= INDEX_RETRY_SECONDS
        )

    def work(self, conn: psycopg.Connection) -> None:
        self.outcome = build(conn, self.model_id, self.dimension, memory_cap=self._memory_cap, session=self._session)

    def failed(self, exc: Exception) -> None:
        if isinstance(exc, IndexNotOwned):
            self.outcome = MISSING
            log.info("%s", exc)
            return
        if isinstance(exc, IndexBuildError):
            self.error = str(exc)
        else:
            self.error = f"could not build the vector index of model {self.model_id}: {one_line(exc)}"
        if not self.stopped.is_set():
            log.warning("%s (search scans exactly until it is built)", self.error)
