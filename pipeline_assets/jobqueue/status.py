"""The states of an embedding job (app.embedding_jobs.status); the diagram and every
transition: docs/state-machine.md.

The SQL in sql/queries/jobs.sql spells these as literals; a test checks that they, and the
table's CHECK constraint, match this enum. A StrEnum member compares (and hashes) equal to
its string, so rows read back as plain strings and counts keyed by members interchange.
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
