"""``partition_embedded`` (on ``embeddings``, partitioned like it: bucket x model, ERROR).

In the run that embeds, one evaluation per partition of the run: every current chunk of
the bucket's documents has a ready vector for the partition's model, none failed, none still
waiting; a failing evaluation names the first failed documents. It reads the run's buckets
only (one query per model), so a backfill in progress elsewhere never makes it fail.
"""

import warnings
from collections.abc import Iterator

import dagster as dg

from pipeline_assets.defs.keys import EMBEDDINGS
from pipeline_assets.defs.partitions import embedding_key, embedding_partitions, keys_by_model
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.store import bucket_rows

COVERAGE_CHECK = "partition_embedded"


def build_coverage_check(n: int) -> dg.AssetChecksDefinition:
    """The check over ``n`` buckets x the model keys (a factory: the bucket count is the settings')."""
    with warnings.catch_warnings():  # partitions_def on an asset check is a "preview" in 1.13
        warnings.filterwarnings("ignore", message=".*partitions_def.*", category=dg.PreviewWarning)

        # Dagster types the decorated function as returning one AssetCheckResult; a partitioned
        # check yields one evaluation per partition and then its Output (Dagster's documented shape).
        @dg.asset_check(  # type: ignore[arg-type]
            asset=EMBEDDINGS,
            name=COVERAGE_CHECK,
            partitions_def=embedding_partitions(n),
            description="Per bucket x model of the run: every current chunk of the bucket's "
            "documents has a ready vector for the model (none failed, none still "
            "waiting).",
        )
        def partition_embedded(
            context: dg.AssetCheckExecutionContext,
            postgres: PostgresResource,
            embedding_provider: EmbeddingProviderResource,
            source: SourceDirectoryResource,
        ) -> Iterator[dg.AssetCheckEvaluation | dg.Output]:
            per_model = keys_by_model(context.op_execution_context.partition_keys)
            root = source.source(embedding_provider.settings()).key
            for model_id, bucket_ids in per_model.items():
                with postgres.connection() as conn:
                    coverage = bucket_rows.coverage_of_buckets(conn, root, bucket_ids, n, model_id)
                for b, cov in coverage.items():
                    yield coverage_evaluation(embedding_key(b, model_id), cov, model_id)
            yield dg.Output(None)  # the check's output: its evaluations are the events above

    return partition_embedded


def coverage_evaluation(key: str, cov: bucket_rows.BucketCoverage, model_id: str) -> dg.AssetCheckEvaluation:
    passed = cov.ready == cov.chunks and cov.failed == 0 and cov.waiting == 0
    metadata: dict = {
        "model": model_id,
        "chunks": cov.chunks,
        "ready": cov.ready,
        "failed": cov.failed,
        "waiting": cov.waiting,
    }
    if cov.failed_ids:
        metadata["failed_ids"] = ", ".join(cov.failed_ids)
    why = (
        None
        if passed
        else (
            f"{cov.chunks - cov.ready} of {cov.chunks} chunk(s) lack a ready vector "
            f"({cov.failed} failed, {cov.waiting} waiting); see `pipeline-assets dlq list`"
        )
    )
    return dg.AssetCheckEvaluation(
        asset_key=EMBEDDINGS,
        check_name=COVERAGE_CHECK,
        partition=key,
        passed=passed,
        metadata=metadata,
        severity=dg.AssetCheckSeverity.ERROR,
        description=why,
    )
