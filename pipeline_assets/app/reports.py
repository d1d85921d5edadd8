"""Read-only views for people: status, spend, dead-letter growth (the queue itself: app/dlq.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row

from pipeline_assets.counts import Counts
from pipeline_assets.jobs.status import JobStatus
from pipeline_assets.store import queries, stage_runs

REPORTS = queries.load("reports")


@dataclass
class StatusReport(Counts):
    """What `status` shows. The per-model and per-status maps are keyed by model id
    and status name; the last fields are filled by ``app.status.status``."""

    documents: dict[str, int]                    # by document status
    jobs: dict[str, int]                         # by job status, every model
    jobs_by_model: dict[str, dict[str, int]]
    stages: dict[str, dict[str, int]]            # stage -> status -> documents
    embed_by_model: dict[str, dict[str, int]]
    coverage: dict[str, dict[str, float]]        # model -> ready, wanted, ratio
    dead_letter: int
    dead_letter_discarded: int                   # of those, given up on (`dlq discard`)
    superseded: int
    quarantined_documents: int
    spend: dict[str, dict[str, int]]             # model -> calls, tokens, inputs, duplicate sends
    breaker: dict[str, dict[str, Any]]           # model -> the provider breaker's state
    vector_index: dict[str, Any] = field(default_factory=dict)     # per active model: hnsw, building...
    vector_index_builds: dict[str, Any] = field(default_factory=dict)  # per model building: its progress
    served_model: str | None = None                                # what search and export read
    retired_models: dict[str, dict[str, Any]] = field(default_factory=dict)
    input_limits: list[dict[str, Any]] = field(default_factory=list)
    retry_after_cap: float | None = None
    database: dict[str, Any] = field(default_factory=dict)         # read_only, in_recovery, workers beating/silent
    backlog: int = 0                             # pending + retry, every model: what the KEDA trigger reads
    sources: list[dict[str, Any]] = field(default_factory=list)    # each source: key, kind, documents, last scan
    watched_source: str | None = None                              # what the Dagster sensor watches


def status(conn: psycopg.Connection) -> StatusReport:
    jobs: dict[str, dict[str, int]] = {}
    for r in _dicts(conn, REPORTS.status_by_model):
        jobs.setdefault(r["model_id"], {})[r["status"]] = r["n"]
    stages_: dict[str, dict[str, int]] = {}
    for r in _dicts(conn, REPORTS.stages):
        stages_.setdefault(r["stage"], {})[r["status"]] = r["n"]
    # The embed stage is computed from the jobs here, never stored by a read.
    embed, embed_by_model = stage_runs.embed_counts(conn)
    if embed:
        stages_["embed"] = embed
    coverage = {r["model_id"]: {"ready": r["ready"], "wanted": r["wanted"],
                                "ratio": (r["ready"] / r["wanted"] if r["wanted"] else 1.0)}
                for r in _dicts(conn, REPORTS.coverage)}
    spend = {r.pop("model_id"): r | {"duplicate_inputs": 0, "extra_sends": 0} for r in _dicts(conn, REPORTS.spend)}
    for r in _dicts(conn, REPORTS.duplicate_sends):  # only the models with duplicate sends
        per_model = spend.setdefault(r["model_id"], {"calls": 0, "tokens": 0, "inputs_ok": 0, "failed_calls": 0})
        per_model["duplicate_inputs"] = r["inputs_sent_more_than_once"]
        per_model["extra_sends"] = r["extra_sends"]
    totals: dict[str, int] = {}
    for per_model in jobs.values():
        for st, n in per_model.items():
            totals[st] = totals.get(st, 0) + n
    return StatusReport(
        documents={r["status"]: r["n"] for r in _dicts(conn, REPORTS.documents)},
        jobs=totals,
        jobs_by_model=jobs,
        stages=stages_,
        embed_by_model=embed_by_model,
        coverage=coverage,
        dead_letter=totals.get(JobStatus.FAILED, 0),
        dead_letter_discarded=dead_letter_discarded(conn),
        superseded=totals.get(JobStatus.SUPERSEDED, 0),
        quarantined_documents=_dicts(conn, REPORTS.quarantined_count)[0]["n"],
        spend=spend,
        breaker={r.pop("model_id"): r for r in _dicts(conn, REPORTS.breaker)},
        database=_dicts(conn, REPORTS.database_state)[0],
        backlog=_dicts(conn, REPORTS.backlog)[0]["backlog"],
    )


def dead_letters(conn: psycopg.Connection) -> list[dict]:
    """The open dead letters (failed jobs, quarantined documents): ``dlq.dead_letters``."""
    from pipeline_assets.app import dlq  # the dead-letter queue's own module (it imports the rerun use case)

    return dlq.dead_letters(conn)


# ---------------------------------------------------------------------------
# Per-document and health read models (what the Dagster layer reports).
# Read-only, set-based; the Dagster assets, sensors and checks report from
# these and hold no SQL of their own.
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DocumentSummary:
    document_id: str
    doc_pk: int
    status: str
    source_checksum: str | None   # hex
    text_checksum: str | None     # hex
    extractor_version: str | None
    chunker_version: str | None
    error_class: str | None
    chunks: int
    tokens: int
    chunks_digest: str            # hex sha256 of the chunk checksums in order


@dataclass(frozen=True)
class Coverage:
    wanted: int
    ready: int
    failed: int
    waiting: int


def document_summaries(conn: psycopg.Connection, root: str,
                       document_ids: Sequence[str]) -> dict[str, DocumentSummary]:
    """State of some documents of one source (``root`` as registered: absolute, resolved)."""
    with conn.cursor(row_factory=class_row(DocumentSummary)) as cur:
        rows = cur.execute(REPORTS.document_summaries, {"root": root, "ids": list(document_ids)}).fetchall()
    return {r.document_id: r for r in rows}


def embedding_coverage(conn: psycopg.Connection, root: str, document_ids: Sequence[str],
                       model_id: str) -> tuple[dict[str, Coverage], Coverage]:
    """Per current document, and in total (distinct checksums), the embedding state for a model."""
    per_doc: dict[str, Coverage] = {}
    total = Coverage(0, 0, 0, 0)
    for counts in _dicts(conn, REPORTS.embedding_coverage, {"root": root, "ids": list(document_ids),
                                                           "model": model_id}):
        doc = counts.pop("document_id")
        cov = Coverage(**{name: int(n) for name, n in counts.items()})
        if doc is None:
            total = cov
        else:
            per_doc[doc] = cov
    return per_doc, total


def missing_embeddings(conn: psycopg.Connection) -> dict[str, dict[str, int]]:
    """Per active model: distinct current chunks wanted, missing a ready vector, and failed."""
    return {r["model_id"]: {"wanted": int(r["wanted"]), "missing": int(r["missing"]), "failed": int(r["failed"])}
            for r in _dicts(conn, REPORTS.missing_embeddings)}


def stale_vectors(conn: psycopg.Connection) -> dict:
    r = _dicts(conn, REPORTS.stale_vectors)[0]
    return {"not_ready": int(r["not_ready"]), "noncurrent_documents": int(r["noncurrent_documents"]),
            "sample": list(r["sample"] or [])}


def dead_letter_growth(conn: psycopg.Connection, window_seconds: float = 3600.0) -> tuple[int, int]:
    """(jobs that became failed within the window, failed jobs in total), neither
    counting the discarded ones (`dlq discard`)."""
    r = _dicts(conn, REPORTS.dead_letter_growth, {"window": window_seconds})[0]
    return int(r["recent"]), int(r["total"])


def dead_letter_discarded(conn: psycopg.Connection) -> int:
    """Failed jobs a person gave up on (`dlq discard`): not in the growth count."""
    return int(_dicts(conn, REPORTS.dead_letter_discarded)[0]["n"])


def sources(conn: psycopg.Connection) -> list[dict]:
    """Each ingested source: its key, kind, documents by status and last complete scan."""
    return _dicts(conn, REPORTS.sources)


def _dicts(conn: psycopg.Connection, query: str, params: dict | None = None) -> list[dict]:
    """The rows of one statement, each a dict keyed by column name."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()
