"""Asset checks on ``embeddings``: coverage, no stale vector current, dead-letter growth.

They run with every materialization of ``embeddings`` and on the health
schedule. Each reads one core query (pipeline_assets.reports) and decides; the
numbers go into the check's metadata so the UI shows why it passed or failed.
"""

import dagster as dg

from pipeline_assets.app import reports
from pipeline_assets.defs.assets import EMBEDDINGS
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource

HOUR_SECONDS = 3600.0


@dg.asset_check(asset=EMBEDDINGS, name="current_chunks_have_ready_embeddings",
                description="Every current chunk has a ready embedding (job ready and vector stored) "
                            "for each active model.")
def current_chunks_embedded(postgres: PostgresResource) -> dg.AssetCheckResult:
    with postgres.connection() as conn:
        per_model = reports.missing_embeddings(conn)
    missing = sum(m["missing"] for m in per_model.values())
    metadata: dict = {"missing": missing, "active_models": len(per_model)}
    for model, counts in per_model.items():
        metadata[f"{model} wanted"] = counts["wanted"]
        metadata[f"{model} missing"] = counts["missing"]
        metadata[f"{model} failed"] = counts["failed"]
    return dg.AssetCheckResult(passed=missing == 0, metadata=metadata,
                               description=None if missing == 0 else
                               f"{missing} current chunk x model pair(s) lack a ready embedding")


@dg.asset_check(asset=EMBEDDINGS, name="no_stale_vector_current",
                description="No vector is stored without a ready job (superseded, failed, pending) and "
                            "none is reachable from a document that is not current (tombstoned, "
                            "quarantined).")
def no_stale_vector_current(postgres: PostgresResource) -> dg.AssetCheckResult:
    with postgres.connection() as conn:
        stale = reports.stale_vectors(conn)
    bad = stale["not_ready"] + stale["noncurrent_documents"]
    metadata = {"vectors_without_ready_job": stale["not_ready"],
                "vectors_of_noncurrent_documents": stale["noncurrent_documents"]}
    if stale["sample"]:
        metadata["sample"] = ", ".join(stale["sample"])
    return dg.AssetCheckResult(passed=bad == 0, metadata=metadata,
                               description=None if bad == 0 else f"{bad} stale vector(s) could be served")


@dg.asset_check(asset=EMBEDDINGS, name="dead_letter_growth",
                description="Failed (dead-lettered) jobs grow by at most PIPELINE_DLQ_GROWTH_PER_HOUR "
                            "(default 10) per hour. A large but stable queue passes: it is a work list.")
def dead_letter_growth(postgres: PostgresResource,
                       embedding_provider: EmbeddingProviderResource) -> dg.AssetCheckResult:
    threshold = embedding_provider.settings().dlq_growth_per_hour
    with postgres.connection() as conn:
        recent, total = reports.dead_letter_growth(conn, HOUR_SECONDS)
    passed = recent <= threshold
    return dg.AssetCheckResult(
        passed=passed,
        metadata={"failed_last_hour": recent, "failed_total": total, "threshold_per_hour": threshold},
        description=None if passed else
        f"{recent} jobs failed in the last hour (threshold {threshold}/h); see `pipeline-assets dlq list`")


CHECKS = [current_chunks_embedded, no_stale_vector_current, dead_letter_growth]
