"""The states of an embedding job (app.embedding_jobs.status).

    pending ──claim──► processing ──complete──► ready
    retry   ──claim──► processing ──retryable / lease expired──► retry
                       processing ──terminal / attempts exhausted──► failed
    failed  ──requeue──► pending
    any but superseded ──content or model no longer wanted──► superseded
    superseded ──content wanted again──► pending
    ready (vector missing) ──repair──► pending

The SQL in sql/queries/jobs.sql spells these as literals; a test checks that
they, and the table's CHECK constraint, match this enum exactly. A StrEnum
member compares (and hashes) equal to its string, so rows read back as plain
strings and counts keyed by members stay interchangeable.
"""

from __future__ import annotations

import enum


class JobStatus(enum.StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    READY = "ready"
    RETRY = "retry"
    SUPERSEDED = "superseded"
    FAILED = "failed"
