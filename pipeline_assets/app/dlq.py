"""The dead-letter queue as a work list: failed jobs and quarantined documents.

* ``groups`` / ``items`` / ``show``: open (and discarded) items by kind and error class; one item
  with its recorded attempts (``app.job_attempts``, failure transitions only) or its stage rows.
* ``requeue``: failed jobs back to pending, quarantined documents re-extracted; ``--all`` and
  ``--error-class`` skip discarded items, named ids do not.
* ``discard``: a person gives up on items, saying why; they leave the work list until they leave
  the dead-letter state (a later failure is new).

Ids: a job id is a number, a document id a path; ``doc:PATH`` forces a path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import rerun as rerun_uc
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.jobqueue import transitions
from pipeline_assets.providers import sanitize
from pipeline_assets.store import dead_letter_rows
from pipeline_assets.store.stage_runs import RerunTarget

# History rows kept per job, the newest (bounds app.job_attempts at this many
# rows per job). The trigger of sql/011 reads app.job_attempts_kept(), which
# must return the same number (a test compares them).
ATTEMPTS_KEPT_PER_JOB = 20

DOCUMENT_PREFIX = "doc:"
_LEASE_OWNER = re.compile(r"^(?P<worker>.*)/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/\d+$")


@dataclass
class Ids:
    """Item ids from the command line, split into job ids and document ids."""

    jobs: list[int] = field(default_factory=list)
    documents: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, raw: Sequence[str]) -> Ids:
        ids = cls()
        for item in raw:
            if item.startswith(DOCUMENT_PREFIX):
                ids.documents.append(item[len(DOCUMENT_PREFIX) :])
            elif item.isdigit():
                ids.jobs.append(int(item))
            else:
                ids.documents.append(item)
        return ids


def worker_of(actor: str | None) -> str | None:
    """The worker id of a lease owner (``worker-id/uuid/seq``); a person's name as is."""
    if actor is None:
        return None
    m = _LEASE_OWNER.match(actor)
    return m.group("worker") if m else actor


def groups(pool: ConnectionPool) -> list[dict]:
    with pool.connection() as conn:
        return [
            {**r, "first_seen": _iso(r["first_seen"]), "last_seen": _iso(r["last_seen"])}
            for r in dead_letter_rows.groups(conn)
        ]


def items(pool: ConnectionPool, *, error_class: str | None = None, discarded: bool = False) -> list[dict]:
    """Failed jobs, then quarantined documents: the open ones, or the discarded ones."""
    with pool.connection() as conn:
        return dead_letters(conn, error_class=error_class, discarded=discarded)


def dead_letters(conn: psycopg.Connection, *, error_class: str | None = None, discarded: bool = False) -> list[dict]:
    """``items`` on one connection (also `dlq` in `status`)."""
    jobs = dead_letter_rows.job_items(conn, error_class, discarded)
    docs = dead_letter_rows.document_items(conn, error_class, discarded)
    out = [
        {
            "kind": "job",
            "id": r["job_id"],
            "model": r["model_id"],
            "error_class": r["error_class"],
            "message": r["error_message"],
            "attempts": r["attempts"],
            "failed_at": _iso(r["updated_at"]),
            "documents": r["documents"] or [],
            **_discard(r),
        }
        for r in jobs
    ]
    out += [
        {
            "kind": "document",
            "id": r["document_id"],
            "source": r["root"],
            "error_class": r["error_class"],
            "message": r["error_message"],
            "failed_at": _iso(r["updated_at"]),
            "documents": [r["document_id"]],
            **_discard(r),
        }
        for r in docs
    ]
    return out


def show(pool: ConnectionPool, item: str) -> dict:
    """One item: a job with its attempts, or the document(s) with that id and their stages.
    ValueError when there is none."""
    ids = Ids.parse([item])
    with pool.connection() as conn:
        if ids.jobs:
            r = dead_letter_rows.job(conn, ids.jobs[0])
            if r is not None:
                attempts = [
                    {
                        "at": _iso(a["recorded_at"]),
                        "worker": worker_of(a["actor"]),
                        "lease": a["actor"],
                        "attempt": a["attempt"],
                        "outcome": a["outcome"],
                        "status": a["status"],
                        "error_class": a["error_class"],
                        "message": a["error_message"],
                    }
                    for a in dead_letter_rows.attempts(conn, r["job_id"])
                ]
                return {
                    "kind": "job",
                    "id": r["job_id"],
                    "model": r["model_id"],
                    "status": r["status"],
                    "attempts": r["attempts"],
                    "max_attempts": r["max_attempts"],
                    "throttles": r["throttles"],
                    "error_class": r["error_class"],
                    "message": r["error_message"],
                    "updated_at": _iso(r["updated_at"]),
                    "chunk_checksum": r["chunk_checksum"],
                    "documents": r["documents"] or [],
                    **_discard(r),
                    "history": attempts,
                    "history_kept": ATTEMPTS_KEPT_PER_JOB,
                }
        docs = dead_letter_rows.documents_named(conn, ids.documents[0] if ids.documents else item)
        if not docs:
            raise ValueError(f"no job or document {item!r}")
        return {
            "kind": "document",
            "id": docs[0]["document_id"],
            "sources": [
                {
                    "source": d["root"],
                    "status": d["status"],
                    "error_class": d["error_class"],
                    "message": d["error_message"],
                    "updated_at": _iso(d["updated_at"]),
                    **_discard(d),
                    "stages": [
                        {**s, "started_at": _iso(s["started_at"]), "finished_at": _iso(s["finished_at"])}
                        for s in dead_letter_rows.document_stages(conn, d["doc_pk"])
                    ],
                }
                for d in docs
            ],
        }


def requeue(
    pool: ConnectionPool,
    runtime: Callable[[], Runtime],
    *,
    ids: Ids | None = None,
    all_jobs: bool = False,
    error_class: str | None = None,
    by: str | None = None,
) -> dict[str, int]:
    """Send dead letters back: named ones (even if discarded), every open failed job
    (``all_jobs``), or every open item of an error class (jobs and documents).
    Jobs go to pending (superseded when their content is no longer wanted);
    documents are re-extracted, which needs a runtime (built only then)."""
    ids = ids or Ids()
    counts = {"requeued": 0, "superseded": 0}
    with pool.connection() as conn:
        with conn.transaction():
            dead_letter_rows.set_actor(conn, sanitize(by or ""))
            job_ids = list(ids.jobs)
            if all_jobs or error_class is not None:
                job_ids += dead_letter_rows.requeue_job_ids(conn, error_class)
            moved = transitions.requeue_failed(conn, sorted(set(job_ids))) if job_ids else {}
        counts["requeued"] = moved.get("pending", 0)
        counts["superseded"] = moved.get("superseded", 0)
        docs = dead_letter_rows.document_items(conn, error_class, False) if error_class is not None else []
        named = [
            r
            for name in ids.documents
            for r in dead_letter_rows.documents_named(conn, name)
            if r["status"] == "quarantined"
        ]
        dead_letter_rows.lift_document_discards(conn, [r["doc_pk"] for r in named])
        docs += named
    if ids.documents or error_class is not None:
        targets = {
            (d["root"], d["document_id"]): RerunTarget(
                root=d["root"],
                document_id=d["document_id"],
                stage="extract",
                status="failed",
                error_class=d["error_class"],
                code_version=None,
            )
            for d in docs
        }
        counts["documents"] = rerun_uc.rerun(runtime(), pool, list(targets.values())) if targets else 0
        with pool.connection() as conn:
            still = dead_letter_rows.document_items(conn, None, False)
        counts["still_quarantined"] = len({(d["root"], d["document_id"]) for d in still} & set(targets))
    return counts


def discard(pool: ConnectionPool, raw_ids: Sequence[str], *, reason: str, by: str) -> dict[str, int]:
    """Give up on dead letters, all or none: ValueError if any id is not one."""
    reason, by = sanitize(reason), sanitize(by)
    if not reason:
        raise ValueError("a discard needs a --reason")
    if not by:
        raise ValueError("a discard needs a name (--by)")
    ids = Ids.parse(raw_ids)
    with pool.connection() as conn, conn.transaction():
        jobs = dead_letter_rows.discard_jobs(conn, ids.jobs, by=by, reason=reason)
        dead_letter_rows.trim_attempts(conn, jobs)
        docs = dead_letter_rows.discard_documents(conn, ids.documents, by=by, reason=reason)
        found = {str(j) for j in jobs}
        missing = [str(j) for j in ids.jobs if str(j) not in found]
        named = {
            n
            for n in ids.documents
            if any(d["status"] == "quarantined" for d in dead_letter_rows.documents_named(conn, n))
        }
        missing += [n for n in ids.documents if n not in named]
        if missing:
            raise _Rollback(missing)
    return {"jobs": len(jobs), "documents": len(docs)}


class _Rollback(ValueError):
    """Raised inside the transaction so nothing of a partly wrong discard is kept."""

    def __init__(self, missing: Sequence[str]) -> None:
        super().__init__(
            f"not in the dead-letter queue (failed job or quarantined document): {', '.join(missing)}"
            "; nothing discarded"
        )


def _discard(r: dict) -> dict:
    if r.get("discarded_by") is None:
        return {"discarded": None}
    return {"discarded": {"by": r["discarded_by"], "reason": r["reason"], "at": _iso(r["discarded_at"])}}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
