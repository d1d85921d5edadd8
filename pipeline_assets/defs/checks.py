"""Asset checks: coverage per bucket with every embeddings run; store health on the schedule.

* ``partition_embedded`` (on ``embeddings``, partitioned like it: bucket x model,
  ERROR): in the run that embeds, one evaluation per partition of the run: every
  current chunk of the bucket's documents has a ready vector for the partition's
  model, none failed, none
  still waiting; a failing evaluation names the first failed documents. It reads
  the run's buckets only (one query), so a backfill in progress elsewhere never
  makes it fail. Dagster writes check evaluations one by one (~20 ms each): one
  per bucket and model, never one per document.
* ``no_stale_vector_current`` (ERROR) and ``dead_letter_growth`` (WARN) read the
  whole store, so they target ``embedding_store``, which no run materializes: they
  run only on the ``pipeline_health_checks`` schedule (or from its page in the UI),
  never after each partition run.

Each reads one query of ``pipeline_assets.app.reports`` and decides; the numbers
go into the check's metadata so the UI shows why it passed or failed.
"""

import warnings
from collections.abc import Iterator

import dagster as dg

from pipeline_assets.app import buckets as bk
from pipeline_assets.app import reports
from pipeline_assets.defs.keys import EMBEDDING_STORE, EMBEDDINGS
from pipeline_assets.defs.partitions import embedding_key, embedding_partitions, keys_by_model
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.settings import Settings

HOUR_SECONDS = 3600.0
COVERAGE_CHECK = "partition_embedded"


def build_coverage_check(settings: Settings) -> dg.AssetChecksDefinition:
    n = settings.partition_buckets
    with warnings.catch_warnings():  # partitions_def on an asset check is a "preview" in 1.13
        warnings.filterwarnings("ignore", message=".*partitions_def.*", category=dg.PreviewWarning)

        # Dagster types the decorated function as returning one AssetCheckResult; a partitioned
        # check yields one evaluation per partition and then its Output (Dagster's documented shape).
        @dg.asset_check(  # type: ignore[arg-type]
                        asset=EMBEDDINGS, name=COVERAGE_CHECK, partitions_def=embedding_partitions(n),
                        description="Per bucket x model of the run: every current chunk of the bucket's "
                                    "documents has a ready vector for the model (none failed, none still "
                                    "waiting).")
        def partition_embedded(context: dg.AssetCheckExecutionContext, postgres: PostgresResource,
                               embedding_provider: EmbeddingProviderResource,
                               source: SourceDirectoryResource) -> Iterator[dg.AssetCheckEvaluation | dg.Output]:
            per_model = keys_by_model(context.op_execution_context.partition_keys)
            root = source.source(embedding_provider.settings()).key
            for model_id, buckets in per_model.items():
                with postgres.connection() as conn:
                    coverage = bk.coverage_of_buckets(conn, root, buckets, n, model_id)
                for b, cov in coverage.items():
                    yield _coverage_evaluation(embedding_key(b, model_id), cov, model_id)
            yield dg.Output(None)  # the check's output: its evaluations are the events above

    return partition_embedded


def _coverage_evaluation(key: str, cov: bk.BucketCoverage, model_id: str) -> dg.AssetCheckEvaluation:
    passed = cov.ready == cov.chunks and cov.failed == 0 and cov.waiting == 0
    metadata: dict = {"model": model_id, "chunks": cov.chunks, "ready": cov.ready, "failed": cov.failed,
                      "waiting": cov.waiting}
    if cov.failed_ids:
        metadata["failed_ids"] = ", ".join(cov.failed_ids)
    why = None if passed else (f"{cov.chunks - cov.ready} of {cov.chunks} chunk(s) lack a ready vector "
                               f"({cov.failed} failed, {cov.waiting} waiting); see `pipeline-assets dlq list`")
    return dg.AssetCheckEvaluation(asset_key=EMBEDDINGS, check_name=COVERAGE_CHECK, partition=key, passed=passed,
                                   metadata=metadata, severity=dg.AssetCheckSeverity.ERROR, description=why)


@dg.asset_check(asset=EMBEDDING_STORE, name="no_stale_vector_current",
                description="No vector is stored without a ready job (superseded, failed, pending) and "
                            "none is reachable from a document that is not current (tombstoned, "
                            "quarantined). Whole store; on the health schedule.")
def no_stale_vector_current(postgres: PostgresResource) -> dg.AssetCheckResult:
    with postgres.connection() as conn:
        stale = reports.stale_vectors(conn)
    bad = stale["not_ready"] + stale["noncurrent_documents"]
    metadata = {"vectors_without_ready_job": stale["not_ready"],
                "vectors_of_noncurrent_documents": stale["noncurrent_documents"]}
    if stale["sample"]:
        metadata["sample"] = ", ".join(stale["sample"])
    return dg.AssetCheckResult(passed=bad == 0, metadata=metadata, severity=dg.AssetCheckSeverity.ERROR,
                               description=None if bad == 0 else f"{bad} stale vector(s) could be served")


@dg.asset_check(asset=EMBEDDING_STORE, name="dead_letter_growth",
                description="Failed (dead-lettered) jobs grow by at most PIPELINE_DLQ_GROWTH_PER_HOUR "
                            "(default 10) per hour; a warning above. A large but stable queue passes: it is "
                            "a work list. Jobs given up on (`dlq discard`) do not count.")
def dead_letter_growth(postgres: PostgresResource,
                       embedding_provider: EmbeddingProviderResource) -> dg.AssetCheckResult:
    threshold = embedding_provider.settings().dlq_growth_per_hour
    with postgres.connection() as conn:
        recent, total = reports.dead_letter_growth(conn, HOUR_SECONDS)
        discarded = reports.dead_letter_discarded(conn)
    passed = recent <= threshold
    return dg.AssetCheckResult(
        passed=passed, severity=dg.AssetCheckSeverity.WARN,
        metadata={"failed_last_hour": recent, "failed_total": total, "threshold_per_hour": threshold,
                  "discarded": discarded},
        description=None if passed else
        f"{recent} jobs failed in the last hour (threshold {threshold}/h); see `pipeline-assets dlq list`")


STORE_CHECKS = [no_stale_vector_current, dead_letter_growth]


def build_checks(settings: Settings) -> list[dg.AssetChecksDefinition]:
    return [build_coverage_check(settings), *STORE_CHECKS]
HEALTH_CHECKS = dg.AssetSelection.checks_for_assets(EMBEDDING_STORE)
