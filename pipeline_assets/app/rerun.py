"""Partial reruns: re-run a stage for exactly the documents a query selects.

The selection is ``stages.rerun_targets`` (app.stage_runs): items whose stage
failed with an error class, or ran under another code version than the
current one. The command line and the Dagster rerun sensor select through
``select`` here, so they cannot disagree on what is stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from psycopg_pool import ConnectionPool

from pipeline_assets.app import stages
from pipeline_assets.app.ingest import ingest_documents
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.app.stages import RerunTarget

# Stages a rerun can target: ingest runs extract and chunk together.
RERUN_STAGES = ("extract", "chunk")


def current_version(rt: Runtime, stage: str) -> str:
    return rt.options.extractor_version if stage == "extract" else rt.options.chunker.version


def select(rt: Runtime, pool: ConnectionPool, *, stages_: Sequence[str] = ("extract",),
           error_class: str | None = None, stale: bool = False,
           limit: int = 1_000_000) -> list[RerunTarget]:
    """Targets of a rerun: per stage, failed with ``error_class`` and/or produced by
    another code version than the current one (``stale``)."""
    targets: list[RerunTarget] = []
    with pool.connection() as conn:
        for stage in stages_:
            targets += stages.rerun_targets(conn, stage=stage, error_class=error_class,
                                            not_version=current_version(rt, stage) if stale else None,
                                            limit=limit)
    return targets


def rerun(rt: Runtime, pool: ConnectionPool, targets: Sequence[RerunTarget]) -> int:
    """Re-extract and re-chunk the targets (forced, even if their bytes did not change);
    returns the documents processed. Chunks whose text did not change keep their jobs."""
    rt.options.force = True
    by_root: dict[str, list[str]] = {}
    for t in targets:
        by_root.setdefault(t.root, []).append(t.document_id)
    total = 0
    for root, ids in by_root.items():
        total += ingest_documents(rt, pool, Path(root), ids).scanned
    return total
