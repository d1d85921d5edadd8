"""Idempotent embedding pipeline: documents -> chunks -> embeddings in PostgreSQL.

The core (this package minus the ``dagster_*`` modules and ``definitions``)
never imports Dagster; the Dagster layer is a thin adapter on top of it.
"""

__version__ = "0.1.0"
