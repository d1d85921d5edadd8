"""The ``embeddings`` asset: vectors by bucket x model, mapped to ``chunks`` by its bucket.

Per model of its partition keys, a run first records the preflight (what it would send,
``app.estimate``) as an observation, then runs ``app.embed_selection.embed_buckets`` over the buckets'
current documents: it ends when their chunks are ready or failed for that model, embedding
them itself (``in_process``, in the ``embedding_worker`` concurrency pool) or waiting for
external ``work`` processes (``EmbeddingRunResource``), and fails with the counts at its
deadline. Only content without a vector for a model is sent. Code version ``vectors-1``: the
model is a partition, not code.
"""

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import estimate, model_runtime
from pipeline_assets.app.embed_selection import BucketsEmbedded, embed_buckets, embed_changed
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.app.vector_wait import EmbedDeadlineExceeded, EmbedIncomplete
from pipeline_assets.defs.embeddings.records import coverage_metadata, embedding_version, run_counts
from pipeline_assets.defs.keys import CHUNKS, EMBEDDINGS, GROUP, SOURCE_FILES
from pipeline_assets.defs.partitions import BUCKET_DIMENSION, embedding_key, embedding_partitions, keys_by_model
from pipeline_assets.defs.provenance import run_version
from pipeline_assets.defs.resources import (
    EmbeddingProviderResource,
    EmbeddingRunResource,
    PostgresResource,
    SourceDirectoryResource,
)
from pipeline_assets.jobqueue.worker import FatalProviderError
from pipeline_assets.providers import ConfigError
from pipeline_assets.store import bucket_rows

# The Dagster concurrency pool of the embeddings step when it embeds in-process:
# its limit (dagster.yaml, `pipeline-assets dev`: 1) is how many runs may run a
# worker at once; the others' steps wait for the slot.
EMBEDDING_POOL = "embedding_worker"

# The embeddings run's worker polls for claimable jobs (a retry coming due) this often, not the CLI's 0.5 s.
WORKER_POLL_SECONDS = 0.1


@contextmanager
def refused_as_failure() -> Iterator[None]:
    """A refusal no retry can mend, as a Dagster failure without retries: the provider refused the
    configuration (``FatalProviderError``), or the model's window is unknown or too small (``ConfigError``)."""
    try:
        yield
    except FatalProviderError as exc:
        raise dg.Failure(
            description=f"embedding provider refused the configuration: {exc}", allow_retries=False
        ) from None
    except ConfigError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None


def embed_or_fail(
    rt: Runtime,
    db_pool: ConnectionPool,
    root: str,
    bucket_ids: list[int],
    n: int,
    in_process: bool,
    embedding_run: EmbeddingRunResource,
    partitions: int,
    documents: list[str] | None = None,
) -> BucketsEmbedded:
    """One model's part of an embeddings run: ``embed_buckets`` (``embed_changed`` when the run
    knows the ``documents`` of the buckets that changed), its failures as Dagster's."""
    deadline = embedding_run.deadline(rt.settings)
    try:
        with refused_as_failure():
            if documents is not None:
                return embed_changed(
                    rt,
                    db_pool,
                    root,
                    documents,
                    bucket_ids,
                    n,
                    poll_seconds=WORKER_POLL_SECONDS,
                    in_process=in_process,
                    deadline_seconds=deadline,
                )
            return embed_buckets(
                rt,
                db_pool,
                root,
                bucket_ids,
                n,
                poll_seconds=WORKER_POLL_SECONDS,
                in_process=in_process,
                deadline_seconds=deadline,
            )
    except EmbedIncomplete as exc:  # the deadline passed, or the worker stopped (a token budget)
        cov = exc.coverage
        why = "deadline passed" if isinstance(exc, EmbedDeadlineExceeded) else "embedding stopped"
        raise dg.Failure(
            description=f"{why}: {exc}",
            allow_retries=isinstance(exc, EmbedDeadlineExceeded),
            metadata={
                "chunks": cov.wanted,
                "ready": cov.ready,
                "failed": cov.failed,
                "outstanding": exc.outstanding,
                "partitions": partitions,
                "in_process": in_process,
                "model": rt.model_id,
            },
        ) from None


def preflight(
    context: dg.AssetExecutionContext | dg.OpExecutionContext,
    rt: Runtime,
    db_pool: ConnectionPool,
    root: str,
    bucket_ids: list[int],
    n: int,
    documents: list[str] | None = None,
) -> estimate.Estimate:
    """Before one model's part of an embeddings run enqueues or sends anything: what it would send
    (``app.estimate.for_buckets``; ``for_document_ids`` when the run embeds ``documents`` of the
    buckets alone), logged and recorded as an observation of the asset, so the run's event log and
    the asset's page show it while the run is still to spend."""
    price = rt.settings.price_per_million_tokens
    if documents is None:
        est = estimate.for_buckets(db_pool, rt.provider.spec, price, root, bucket_ids, n)
    else:
        est = estimate.for_document_ids(db_pool, rt.provider.spec, price, root, documents)
    context.log.info(f"preflight: {est.describe()}")
    context.log_event(
        dg.AssetObservation(
            asset_key=EMBEDDINGS,
            description="preflight: what this run would send",
            metadata={
                "preflight": True,
                "buckets": len(bucket_ids),
                **{k: v for k, v in est.as_dict().items() if v is not None},
            },
        )
    )
    return est


def build_embeddings(code_version: str, n: int, concurrency_pool: str | None) -> dg.AssetsDefinition:
    """The asset over ``n`` buckets x the model keys (a factory: the bucket count, the code
    version and whether runs embed in-process, hence hold ``concurrency_pool``, are the settings')."""
    spec: dict[str, Any] = dict(group_name=GROUP, kinds={"postgres"})
    with warnings.catch_warnings():  # backfill_policy and this mapping are "beta" in 1.13
        warnings.filterwarnings("ignore", message=".*backfill_policy.*", category=dg.BetaWarning)
        warnings.filterwarnings("ignore", message=".*MultiToSingleDimensionPartitionMapping.*", category=dg.BetaWarning)

        @dg.asset(
            name="embeddings",
            code_version=code_version,
            pool=concurrency_pool,
            partitions_def=embedding_partitions(n),
            backfill_policy=dg.BackfillPolicy.single_run(),
            deps=[
                dg.AssetDep(
                    key,
                    partition_mapping=dg.MultiToSingleDimensionPartitionMapping(
                        partition_dimension_name=BUCKET_DIMENSION
                    ),
                )
                for key in (CHUNKS, SOURCE_FILES)
            ],
            **spec,
            description="Vectors of the buckets' chunks, per bucket x model (app.embeddings): one column per "
            "active model of the registry. A run ends when the chunks of its own buckets are ready "
            "or failed for its models (a worker in the run embeds them, or external `work` "
            "processes do), or fails at its deadline with the counts. Per partition: coverage "
            "and failed document ids.",
        )
        def embeddings(
            context: dg.AssetExecutionContext,
            postgres: PostgresResource,
            embedding_provider: EmbeddingProviderResource,
            source: SourceDirectoryResource,
            embedding_run: EmbeddingRunResource,
        ) -> dg.MaterializeResult:
            """Embed the buckets' chunks with each model of the run's partitions, first (the rest of
            the queue is others' work).

            Jobs are keyed by (chunk checksum, model): only content without a vector for a model is
            sent, so a model's column is backfilled by sending what it lacks, and re-materializing a
            partition where nothing changed calls no provider.
            """
            started = time.monotonic()
            keys = list(context.partition_keys)
            per_model = keys_by_model(keys)
            settings = embedding_provider.settings()
            in_process = embedding_run.embeds_in_process(settings)
            root = source.source(settings).key
            db_pool = postgres.pool()
            with postgres.connection() as conn:
                try:
                    bucket_rows.check_buckets(conn, n)
                except bucket_rows.BucketCountMismatch as exc:
                    raise dg.Failure(description=str(exc), allow_retries=False) from None
            versions: dict[str, str] = {}
            totals: dict[str, int] = {}
            documents = 0
            waited = 0.0
            put_off: list[str] = []  # models whose index build was left for later (an ingest runs)
            for model_id, bucket_ids in per_model.items():
                try:
                    rt = model_runtime.runtime_of(settings, db_pool, model_id, dagster_run_id=context.run.run_id)
                except ConfigError as exc:
                    raise dg.Failure(description=str(exc), allow_retries=False) from None

                est = preflight(context, rt, db_pool, root, bucket_ids, n)
                done = embed_or_fail(rt, db_pool, root, bucket_ids, n, in_process, embedding_run, len(keys))
                context.log.info(
                    f"{model_id}: {len(bucket_ids)} bucket(s) embedded and waited on "
                    f"({done.waited_seconds:.2f} s waited)"
                )
                if done.index_put_off:
                    context.log.info(done.index_put_off)
                    put_off.append(done.index_put_off)
                with postgres.connection() as conn:
                    states = bucket_rows.states_of(conn, root, bucket_ids, n)
                for b in bucket_ids:
                    bucket_cov, key = done.per_bucket[b], embedding_key(b, model_id)
                    versions[key] = embedding_version(model_id, states[b], bucket_cov)
                    context.add_asset_metadata(coverage_metadata(bucket_cov), partition_key=key)
                for name, value in run_counts(est, done).items():
                    totals[name] = totals.get(name, 0) + value
                documents = max(documents, sum(state.documents for state in states.values()))
                waited += done.waited_seconds
            ready = totals.pop("ready", 0)
            return dg.MaterializeResult(
                data_version=dg.DataVersion(run_version(versions)),
                metadata={
                    "model": ", ".join(per_model),
                    **totals,
                    "coverage_ratio": round(ready / totals["chunks"], 6) if totals.get("chunks") else 1.0,
                    "partitions": len(keys),
                    "documents": documents,
                    "in_process": in_process,
                    "waited_seconds": round(waited, 3),
                    "duration_seconds": round(time.monotonic() - started, 3),
                    **({"vector_index": " ".join(put_off)} if put_off else {}),
                },
            )

    return embeddings
