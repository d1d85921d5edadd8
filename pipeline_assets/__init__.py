"""Idempotent embedding pipeline: documents -> chunks -> embeddings in PostgreSQL.

Nothing outside ``defs/`` imports Dagster: the Dagster layer is a thin adapter over the use
cases in ``app/`` (the layers: docs/architecture.md).
"""

__version__ = "0.1.0"
