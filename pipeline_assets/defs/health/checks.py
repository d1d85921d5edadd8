"""The store's health checks, on ``embedding_store`` (never materialized): whole-store queries
run by the ``pipeline_health_checks`` schedule (or from the UI), never after a partition run.

* ``no_stale_vector_current`` (ERROR): no vector without a ready job, none reachable from a
  document that is not current;
* ``dead_letter_growth`` (WARN): failed jobs grow by at most PIPELINE_DLQ_GROWTH_PER_HOUR an hour.

Each reads one query of ``store.reports``; the numbers go into the check's metadata.
"""

import dagster as dg

from pipeline_assets.defs.keys import EMBEDDING_STORE
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource
from pipeline_assets.store import reports

HOUR_SECONDS = 3600.0


@dg.asset_check(
    asset=EMBEDDING_STORE,
    name="no_stale_vector_current",
    description="No vector is stored without a ready job (superseded, failed, pending) and "
    "none is reachable from a document that is not current (tombstoned, "
    "quarantined). Whole store; on the health schedule.",
)
def no_stale_vector_current(postgres: PostgresResource) -> dg.AssetCheckResult:
    with postgres.connection() as conn:
        stale = reports.stale_vectors(conn)
    bad = stale["not_ready"] + stale["noncurrent_documents"]
    metadata = {
        "vectors_without_ready_job": stale["not_ready"],
        "vectors_of_noncurrent_documents": stale["noncurrent_documents"],
    }
    if stale["sample"]:
        metadata["sample"] = ", ".join(stale["sample"])
    return dg.AssetCheckResult(
        passed=bad == 0,
        metadata=metadata,
        severity=dg.AssetCheckSeverity.ERROR,
        description=None if bad == 0 else f"{bad} stale vector(s) could be served",
    )


@dg.asset_check(
    asset=EMBEDDING_STORE,
    name="dead_letter_growth",
    description="Failed (dead-lettered) jobs grow by at most PIPELINE_DLQ_GROWTH_PER_HOUR "
    "(default 10) per hour; a warning above. A large but stable queue passes: it is "
    "a work list. Jobs given up on (`dlq discard`) do not count.",
)
def dead_letter_growth(
    postgres: PostgresResource, embedding_provider: EmbeddingProviderResource
) -> dg.AssetCheckResult:
    threshold = embedding_provider.settings().dagster_config().dlq_growth_per_hour
    with postgres.connection() as conn:
        recent, total = reports.dead_letter_growth(conn, HOUR_SECONDS)
        discarded = reports.dead_letter_discarded(conn)
    passed = recent <= threshold
    return dg.AssetCheckResult(
        passed=passed,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "failed_last_hour": recent,
            "failed_total": total,
            "threshold_per_hour": threshold,
            "discarded": discarded,
        },
        description=None
        if passed
        else f"{recent} jobs failed in the last hour (threshold {threshold}/h); see `pipeline-assets dlq list`",
    )


STORE_CHECKS = [no_stale_vector_current, dead_letter_growth]
HEALTH_CHECKS = dg.AssetSelection.checks_for_assets(EMBEDDING_STORE)
