"""Embed some documents, or the documents of some buckets, and wait: make sure their current
chunks have jobs, then wait until each is ready or failed (not for the rest of the queue), with
a worker scoped to them here or only the ``work`` processes elsewhere, within a deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from psycopg_pool import ConnectionPool

from pipeline_assets.app import vector_wait
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.jobqueue.worker import WorkerReport
from pipeline_assets.store import bucket_rows, reports

log = logging.getLogger(__name__)


@dataclass
class DocumentsEmbedded:
    """What embedding some documents of a source did, and their coverage before and after."""

    work: WorkerReport
    enqueued: int
    summaries: dict[str, reports.DocumentSummary]
    before: reports.Coverage  # the first read (the run's worker, if any, already started)
    after: reports.Coverage
    per_document: dict[str, reports.Coverage] = field(default_factory=dict)
    in_process: bool = True
    waited_seconds: float = 0.0
    index_put_off: str | None = None  # the model's index build left for later (an ingest runs): the line


def embed_and_wait(
    rt: Runtime,
    pool: ConnectionPool,
    root: Path | str,
    document_ids: Sequence[str],
    *,
    poll_seconds: float | None = None,
    in_process: bool = True,
    deadline_seconds: float | None = None,
) -> DocumentsEmbedded:
    """Make sure the current chunks of some documents have jobs, then wait until
    each of them is ready or failed: not for the rest of the queue.

    ``in_process``: a worker scoped to these documents (it claims only their
    jobs) embeds them here; otherwise only ``work`` processes elsewhere do, and
    this waits. ``deadline_seconds`` (default: the settings') bounds the wait:
    past it, EmbedDeadlineExceeded with the counts. A worker that stopped before
    they were done (BudgetExhausted, WorkerFault) is EmbedStopped with its message
    and the counts; FatalProviderError is raised as it is.
    """
    root_s = str(root)
    summaries: dict[str, reports.DocumentSummary] = {}

    def current_pks() -> list[int]:
        with pool.connection() as conn:
            summaries.update(reports.document_summaries(conn, root_s, document_ids))
        return [s.doc_pk for s in summaries.values() if s.status == "current"]

    def read() -> tuple[dict[str, reports.Coverage], reports.Coverage]:
        with pool.connection() as conn:
            return reports.embedding_coverage(conn, root_s, document_ids, rt.model_id)

    waited = vector_wait.wait_for_vectors(
        rt,
        pool,
        current_pks,
        read,
        many=len(document_ids) > vector_wait.SCOPE_MAX_DOCUMENTS,
        poll_seconds=poll_seconds,
        in_process=in_process,
        deadline_seconds=deadline_seconds,
    )
    return DocumentsEmbedded(
        work=waited.work,
        enqueued=waited.enqueued,
        summaries=summaries,
        before=waited.before,
        after=waited.after,
        per_document=waited.detail,
        in_process=in_process,
        waited_seconds=waited.seconds,
        index_put_off=waited.index_put_off,
    )


@dataclass
class BucketsEmbedded:
    """What embedding some buckets' documents did: per bucket and in total (distinct chunks)."""

    work: WorkerReport
    enqueued: int
    documents: int  # current documents waited for (the buckets', or the changed ones: embed_changed)
    before: reports.Coverage
    after: reports.Coverage
    per_bucket: dict[int, bucket_rows.BucketCoverage]
    in_process: bool = True
    waited_seconds: float = 0.0
    index_put_off: str | None = None  # the model's index build left for later (an ingest runs): the line


def embed_buckets(
    rt: Runtime,
    pool: ConnectionPool,
    root: Path | str,
    bucket_ids: Sequence[int],
    bucket_count: int,
    *,
    poll_seconds: float | None = None,
    in_process: bool = True,
    deadline_seconds: float | None = None,
) -> BucketsEmbedded:
    """``embed_and_wait`` for the current documents of some buckets (of ``bucket_count``), read and
    counted per bucket in the database: no per-document object at any corpus size (an
    embeddings run over 100k documents holds their keys, not their summaries)."""
    root_s = str(root)

    def current_pks() -> Sequence[int]:
        with pool.connection() as conn:
            return bucket_rows.current_pks(conn, root_s, bucket_ids, bucket_count)

    def read() -> tuple[dict[int, bucket_rows.BucketCoverage], reports.Coverage]:
        with pool.connection() as conn:
            return bucket_rows.coverage_and_total(conn, root_s, bucket_ids, bucket_count, rt.model_id)

    with pool.connection() as conn:  # a large run's worker starts before the keys are read
        many = bucket_rows.estimated_documents(conn, root_s, bucket_ids, bucket_count) > vector_wait.SCOPE_MAX_DOCUMENTS
    waited = vector_wait.wait_for_vectors(
        rt,
        pool,
        current_pks,
        read,
        many=many,
        poll_seconds=poll_seconds,
        in_process=in_process,
        deadline_seconds=deadline_seconds,
    )
    return BucketsEmbedded(
        work=waited.work,
        enqueued=waited.enqueued,
        documents=waited.documents,
        before=waited.before,
        after=waited.after,
        per_bucket=waited.detail,
        in_process=in_process,
        waited_seconds=waited.seconds,
        index_put_off=waited.index_put_off,
    )


def embed_changed(
    rt: Runtime,
    pool: ConnectionPool,
    root: Path | str,
    document_ids: Sequence[str],
    bucket_ids: Sequence[int],
    bucket_count: int,
    *,
    poll_seconds: float | None = None,
    in_process: bool = True,
    deadline_seconds: float | None = None,
) -> BucketsEmbedded:
    """``embed_buckets`` for a run that knows which documents of its buckets changed (every one
    it ingested, recorded or tombstoned): ``embed_and_wait`` for those alone, then ONE read of
    the buckets' coverage, whole buckets, for what the run records. If that read shows other
    chunks of the buckets outstanding (a concurrent run, an earlier failure), ``embed_buckets``
    waits for the buckets whole: nothing is reported embedded that is not."""
    changed = embed_and_wait(
        rt,
        pool,
        root,
        document_ids,
        poll_seconds=poll_seconds,
        in_process=in_process,
        deadline_seconds=deadline_seconds,
    )
    with pool.connection() as conn:
        per_bucket, total = bucket_rows.coverage_and_total(conn, str(root), bucket_ids, bucket_count, rt.model_id)
    if vector_wait.outstanding(total):
        log.info(
            "%d chunk(s) of the buckets besides the %d changed document(s) are outstanding: waiting for the buckets",
            vector_wait.outstanding(total),
            len(document_ids),
        )
        whole = embed_buckets(
            rt,
            pool,
            root,
            bucket_ids,
            bucket_count,
            poll_seconds=poll_seconds,
            in_process=in_process,
            deadline_seconds=deadline_seconds,
        )
        whole.enqueued += changed.enqueued
        whole.work.add(**{k: v for k, v in changed.work.as_dict().items() if isinstance(v, int)})
        return whole
    return BucketsEmbedded(
        work=changed.work,
        enqueued=changed.enqueued,
        documents=sum(1 for s in changed.summaries.values() if s.status == "current"),
        before=changed.before,
        after=total,
        per_bucket=per_bucket,
        in_process=in_process,
        waited_seconds=changed.waited_seconds,
        index_put_off=changed.index_put_off,
    )
