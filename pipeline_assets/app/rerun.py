"""Partial reruns: re-run a stage for exactly the documents a query selects.

The selection is ``stage_runs.rerun_targets`` (one query over app.stage_runs; every filter optional and
combinable); the command line, the Dagster rerun sensor and a bucket run all select through
``pages`` (keyset pages, no limit), so they cannot disagree on what is stale. The extractor's
current version is per format.

* ``extract`` / ``chunk``: re-ingest the documents, forced; chunks whose text did not change keep
  their jobs and vectors (nothing sent).
* ``embed``: requeue the failed jobs of the documents' current chunks and enqueue missing ones;
  ready vectors are never sent again (a provider-side change is a new model id).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg_pool import ConnectionPool

from pipeline_assets.app import estimate
from pipeline_assets.app.ingest import ingest_documents, register_model
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.app.source_registry import open_source
from pipeline_assets.jobqueue import transitions
from pipeline_assets.store import documents as documents_
from pipeline_assets.store import stage_runs
from pipeline_assets.store.stage_runs import RerunTarget

# Stages a rerun can target; the rerun sensor reruns the first two after a version bump.
RERUN_STAGES = ("extract", "chunk", "embed")
VERSIONED_STAGES = ("extract", "chunk")
STATUSES = ("succeeded", "failed", "skipped", "pending")
# Targets read per query: a rerun's memory is bounded by a page, not by what it selects.
TARGET_PAGE = 10_000
# --before-version compares the number a version ends with (extract-1 < extract-2).
_NUMBERED = re.compile(r"[0-9]+$")


@dataclass(frozen=True)
class EmbedRerun:
    documents: int
    requeued: int
    enqueued: int

    def __add__(self, other: EmbedRerun) -> EmbedRerun:
        return EmbedRerun(
            self.documents + other.documents, self.requeued + other.requeued, self.enqueued + other.enqueued
        )


def pages(
    rt: Runtime,
    pool: ConnectionPool,
    *,
    stages_: Sequence[str] = ("extract",),
    error_class: str | None = None,
    stale: bool = False,
    statuses: Sequence[str] = (),
    before_version: str | None = None,
    documents: Sequence[str] = (),
    root: str | None = None,
    bucket_ids: Sequence[int] | None = None,
    bucket_count: int = 0,
    page_size: int | None = None,
) -> Iterator[list[RerunTarget]]:
    """Targets of a rerun, per stage: every given filter holds. ``stale``: produced by another
    code version than the current one (for extract, the current version of the document's
    format); ``before_version``: by an older one; ``documents``: id globs; ``root``: one
    source (default: every one); ``bucket_ids``: only documents in these buckets (of ``bucket_count``).
    For embed the targets are the current model's rows, refreshed from the jobs first;
    ``stale`` and ``before_version`` do not apply to it (its version is the model).
    ValueError if misused.

    Every target, however many, a page of at most ``page_size`` (default TARGET_PAGE) at a
    time, per stage and source in document order (keyset: each page starts past the last
    document of the one before, so a caller may rerun a page before reading the next)."""
    if before_version is not None and not _NUMBERED.search(before_version):
        raise ValueError(f"--before-version {before_version!r} must end with a number (e.g. extract-2)")
    unknown = set(statuses) - set(STATUSES)
    if unknown:
        raise ValueError(f"unknown status {sorted(unknown)}; statuses: {', '.join(STATUSES)}")
    size = page_size or TARGET_PAGE
    for stage in stages_:
        filters: dict[str, Any] = dict(
            stage=stage,
            error_class=error_class,
            statuses=statuses,
            documents=documents,
            before_version=before_version,
            buckets=bucket_ids,
            n=bucket_count,
            limit=size,
        )
        with pool.connection() as conn:
            if stage == "embed":
                if stale or before_version:
                    raise ValueError(
                        "--stale and --before-version compare extractor and chunker versions; the "
                        "embed stage's version is its model (select with --status / --error-class)"
                    )
                stage_runs.refresh_embed(conn, rt.model_id)
                filters["model_id"] = rt.model_id  # one row per document: the keyset holds
            elif stale and stage == "extract":
                versions = rt.options.extractor_version
                filters.update(not_version=versions.default, versions_by_extension=versions.by_extension())
            elif stale:
                filters["not_version"] = rt.options.chunker.version
            roots = [root] if root is not None else documents_.source_roots(conn)
        for source in roots:
            after = ""
            while True:
                with pool.connection() as conn:
                    page = stage_runs.rerun_targets(conn, **filters, root=source, after=after)
                if not page:
                    break
                yield page
                if len(page) < size:
                    break
                after = page[-1].document_id


def select(rt: Runtime, pool: ConnectionPool, *, limit: int | None = None, **filters: Any) -> list[RerunTarget]:
    """Every target ``pages`` yields (the same filters), or the first ``limit`` of them."""
    targets: list[RerunTarget] = []
    for page in pages(rt, pool, **filters):
        targets += page
        if limit is not None and len(targets) >= limit:
            return targets[:limit]
    return targets


def rerun(rt: Runtime, pool: ConnectionPool, targets: Sequence[RerunTarget]) -> int:
    """Re-extract and re-chunk the targets' documents (forced, even if their bytes did not change);
    returns the documents processed. Chunks whose text did not change keep their jobs."""
    rt.options.force = True
    total = 0
    for root, ids in _by_root(targets).items():
        total += ingest_documents(rt, pool, open_source(root, rt.settings.source_config()), ids).scanned
    return total


def rerun_embed(rt: Runtime, pool: ConnectionPool, targets: Sequence[RerunTarget]) -> EmbedRerun:
    """Requeue the failed jobs and enqueue the missing ones of the targets' current chunks,
    for the runtime's model. Ready vectors are left alone (never billed again)."""
    documents = requeued = enqueued = 0
    with pool.connection() as conn:
        register_model(conn, rt)
        for root, ids in _by_root(targets).items():
            with conn.transaction():
                pks = stage_runs.current_document_pks(conn, root, ids)
                failed = stage_runs.failed_jobs_of(conn, root, ids, rt.model_id)
                requeued += transitions.requeue_failed(conn, failed)["pending"] if failed else 0
                enqueued += transitions.enqueue_for_docs(conn, pks, rt.options.config.max_attempts)
                stage_runs.refresh_embed_docs(conn, rt.model_id, pks)
            documents += len(pks)
    return EmbedRerun(documents=documents, requeued=requeued, enqueued=enqueued)


def current_pks(pool: ConnectionPool, targets: Sequence[RerunTarget]) -> list[int]:
    """The keys of the targets' current documents (what ``rerun_embed`` enqueues for)."""
    pks: list[int] = []
    with pool.connection() as conn:
        for root, ids in _by_root(targets).items():
            pks += stage_runs.current_document_pks(conn, root, ids)
    return pks


def estimate_embed(rt: Runtime, pool: ConnectionPool, pks: Sequence[int]) -> estimate.Estimate:
    """What ``rerun_embed`` of these documents (keys) and the work after it would send for the
    runtime's model: their current content without a vector, dead-lettered content included
    (it is requeued). Writes nothing."""
    return estimate.for_documents(
        pool, rt.provider.spec, rt.settings.price_per_million_tokens, pks, requeue_failed=True
    )


def _by_root(targets: Sequence[RerunTarget]) -> dict[str, list[str]]:
    """Document ids per source root, each once, in order."""
    by_root: dict[str, dict[str, None]] = {}
    for t in targets:
        by_root.setdefault(t.root, {})[t.document_id] = None
    return {root: list(ids) for root, ids in by_root.items()}
