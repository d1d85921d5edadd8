"""``embedding_store``: the job table and the vectors search serves, observed and checked
(``health/checks.py``, the model switch's observations), never materialized by Dagster."""

import dagster as dg

from pipeline_assets.defs.keys import EMBEDDING_STORE, GROUP

EMBEDDING_STORE_SPEC = dg.AssetSpec(
    EMBEDDING_STORE,
    group_name=GROUP,
    kinds={"postgres"},
    description="The job table and the vectors search serves (app.embedding_jobs, app.embeddings). Not "
    "materialized by Dagster: its health checks (stale vectors, dead-letter growth) run on the "
    "pipeline_health_checks schedule, never in the runs that embed.",
)
