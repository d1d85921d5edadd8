"""Embeddings: ``embeddings`` by bucket x model, ``embed_documents``, ``embed_after_sync`` and
the ``partition_embedded`` check."""

import dagster as dg

from pipeline_assets.app.runtime import code_versions
from pipeline_assets.defs.embeddings.assets import EMBEDDING_POOL, build_embeddings
from pipeline_assets.defs.embeddings.checks import build_coverage_check
from pipeline_assets.defs.embeddings.jobs import EMBED_JOB
from pipeline_assets.defs.embeddings.sensors import embed_after_sync
from pipeline_assets.settings import Settings


def definitions(settings: Settings) -> dg.Definitions:
    """The domain under ``settings``: code version, bucket count, in-process embedding (the pool)."""
    config = settings.dagster_config()
    n = config.partition_buckets
    concurrency_pool = EMBEDDING_POOL if config.in_process else None
    return dg.Definitions(
        assets=[build_embeddings(code_versions(settings)["embeddings"], n, concurrency_pool)],
        asset_checks=[build_coverage_check(n)],
        jobs=[EMBED_JOB],
        sensors=[embed_after_sync],
    )
