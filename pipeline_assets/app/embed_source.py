"""`embed SOURCE`, the one-shot use case: ingest the source with a worker beside it, then
work until idle, and summarise what was done."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from psycopg_pool import ConnectionPool

from pipeline_assets.app import model_admin, reports
from pipeline_assets.app.embed import work
from pipeline_assets.app.ingest import ingest_source, register_model
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.content.source import Source
from pipeline_assets.jobs.worker import Worker, WorkerReport
from pipeline_assets.settings import DEFAULT_CONCURRENCY


@dataclass
class DirectoryEmbedded:
    """What `embed DIR` did (its summary line and JSON)."""

    model: str
    documents: int            # scanned
    documents_changed: int    # new or changed
    quarantined: int
    deleted: int
    chunks: int
    embedded: int             # vectors stored by this run
    reused: int               # ready vectors it did not have to make
    failed: int               # the model's dead-lettered jobs
    provider_calls: int
    coverage: str             # "ready/wanted" for the model
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def embed_directory(rt: Runtime, pool: ConnectionPool, root: Source | Path, *,
                    concurrency: int = DEFAULT_CONCURRENCY, stop: threading.Event | None = None,
                    observe: Callable[[Worker], None] | None = None) -> DirectoryEmbedded:
    """`embed SOURCE`: ingest the source with a worker beside it (it claims each batch once the
    ingest commits it), then work until idle (the vector index is built at that drain, after
    the ingest's inserts), and summarise. An error of the ingest stops the worker and is
    raised; one of the worker (a fatal provider error, a budget) is raised after the ingest."""
    started = time.monotonic()
    model_admin.check_input_limits(rt.settings, pool, rt.provider.spec)   # before the ingest, not after
    with pool.connection() as conn:
        register_model(conn, rt)   # a new model's jobs for what was ingested before it, before its worker
    stop = stop or threading.Event()
    beside = _WorkerBeside(rt, pool, concurrency=concurrency, stop=stop, observe=observe)
    try:
        ing = ingest_source(rt, pool, root)
    except BaseException:
        stop.set()
        beside.join()
        raise
    done = beside.finish()
    with pool.connection() as conn:
        st = reports.status(conn)
    cov = st.coverage.get(rt.model_id, {"ready": 0, "wanted": 0})
    return DirectoryEmbedded(
        model=rt.model_id,
        documents=ing.scanned,
        documents_changed=ing.new + ing.changed,
        quarantined=ing.quarantined,
        deleted=ing.deleted,
        chunks=ing.chunks,
        embedded=done.embedded,
        reused=max(int(cov["ready"]) - done.embedded, 0),
        failed=st.jobs_by_model.get(rt.model_id, {}).get("failed", 0),
        provider_calls=done.provider_calls,
        coverage=f"{int(cov['ready'])}/{int(cov['wanted'])}",
        seconds=round(time.monotonic() - started, 2),
    )


class _WorkerBeside:
    """``work`` in a thread, started before an ingest (not until idle: the queue empties between
    the ingest's batches); ``finish`` makes it stop when idle and returns its report."""

    def __init__(self, rt: Runtime, pool: ConnectionPool, *, concurrency: int, stop: threading.Event,
                 observe: Callable[[Worker], None] | None) -> None:
        self._worker: Worker | None = None
        self._ready = threading.Event()   # the Worker exists (or work() failed before it did)
        self._report: WorkerReport | None = None
        self._error: BaseException | None = None

        def watch(worker: Worker) -> None:
            self._worker = worker
            self._ready.set()
            if observe is not None:
                observe(worker)

        def run() -> None:
            try:
                self._report = work(rt, pool, concurrency=concurrency, stop=stop, observe=watch)
            except BaseException as exc:  # raised by finish(), after the ingest
                self._error = exc
            finally:
                self._ready.set()

        self._thread = threading.Thread(target=run, name="embed-worker", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def finish(self) -> WorkerReport:
        self._ready.wait()
        if self._worker is not None:
            self._worker.finish_when_idle()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report
