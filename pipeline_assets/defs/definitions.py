"""The Dagster code location: one ``Definitions`` merged from the domains under ``defs/``.

Loaded by ``workspace.yaml`` and the deploy manifests as ``pipeline_assets.defs.definitions:defs``.
Each domain (ingest, embeddings, models, reconcile, health) gives its assets, jobs, sensors,
schedules and checks; the resources (``resources.py``) are shared. Everything here is wiring
over the use cases of ``pipeline_assets.app``, which know nothing of Dagster.

Executor: in-process for every job. A run is one step per asset doing set-based database
work (the parallelism lives in the worker's threads and the job table), and the multiprocess
executor would start a Python process per step (docs/dagster.md, "Layout").
"""

import dagster as dg

from pipeline_assets.defs import embeddings, health, ingest, models, reconcile
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.settings import Settings

DOMAINS = (ingest, embeddings, models, reconcile, health)


def build_definitions(settings: Settings | None = None) -> dg.Definitions:
    """Definitions from one Settings (default: read from the environment now):
    code versions, bucket count, cron strings, sensor interval, the database."""
    settings = settings or Settings.from_env()
    return dg.Definitions.merge(
        *(domain.definitions(settings) for domain in DOMAINS),
        dg.Definitions(resources=build_resources(settings), executor=dg.in_process_executor),
    )


defs = build_definitions()
