"""``sync_and_embed``: the source sensor's run after a change, its sync and its embeddings in ONE run.

Tagged ``pipeline/pending_buckets`` (the buckets its tick found new, changed or gone files in) and
partitioned like ``documents`` (the range spanning them, which the sensor's failure handling reads),
it does for those buckets what a ``sync_documents`` run and the ``embed_documents`` run after it do,
without a second run launch or a sensor interval between them: ``sync_pending`` syncs them from the
tick's observations (no walk; stale documents re-extracted) and records their ``documents`` and
``chunks``; ``embed_synced`` embeds them for every active model (in the ``embedding_worker`` pool
when in-process), records their ``embeddings`` cells and a ``partition_embedded`` evaluation each.
Every event carries the versions an asset run records (``provenance``), so staleness stays true;
the other buckets of the range keep what they had.
"""

import time
from collections.abc import Iterator
from typing import Any

import dagster as dg

from pipeline_assets.app import buckets as bk
from pipeline_assets.app import model_admin, model_runtime
from pipeline_assets.app.runtime import code_versions
from pipeline_assets.content.source import SourceError
from pipeline_assets.defs.embeddings.assets import embed_or_fail, preflight
from pipeline_assets.defs.embeddings.checks import coverage_evaluation
from pipeline_assets.defs.embeddings.records import coverage_metadata, embedding_version, run_counts
from pipeline_assets.defs.ingest.assets import ingest_materializations
from pipeline_assets.defs.keys import CHUNKS, EMBEDDINGS, SOURCE_FILES
from pipeline_assets.defs.partitions import (
    MODEL_PARTITIONS_NAME,
    bucket_key,
    bucket_partitions,
    embedding_key,
    is_model_key,
)
from pipeline_assets.defs.provenance import latest_observation, versioned_events
from pipeline_assets.defs.resources import (
    EmbeddingProviderResource,
    EmbeddingRunResource,
    PostgresResource,
    SourceDirectoryResource,
)
from pipeline_assets.defs.run_requests import PENDING_TAG, SYNC_EMBED_JOB_NAME, pending_buckets
from pipeline_assets.providers import ConfigError
from pipeline_assets.store import bucket_rows

SYNC_OP = "sync_pending"
EMBED_OP = "embed_synced"


def _pending(context: dg.OpExecutionContext) -> list[int]:
    buckets = pending_buckets(context.run.tags)
    if not buckets:
        raise dg.Failure(
            description=f"a {SYNC_EMBED_JOB_NAME} run syncs the buckets of its tag {PENDING_TAG} "
            "(the source sensor sets it); this run has none",
            allow_retries=False,
        )
    return buckets


def _models(instance: dg.DagsterInstance, active: list[str]) -> list[str]:
    """The active models that can be keys of the ``model`` dimension, each key added if missing."""
    models = [m for m in active if is_model_key(m)]
    missing = [m for m in models if m not in instance.get_dynamic_partitions(MODEL_PARTITIONS_NAME)]
    if missing:  # a model added since the last tick of embed_after_sync or model_switch: its column, now
        instance.add_dynamic_partitions(MODEL_PARTITIONS_NAME, missing)
    return models


def build_sync_and_embed_job(n: int, concurrency_pool: str | None) -> dg.JobDefinition:
    """The job over ``n`` buckets; its embeddings op holds ``concurrency_pool`` (when in-process)."""

    @dg.op(name=SYNC_OP, description="Sync the tagged buckets from the tick's observations; record them.")
    def sync_pending(
        context: dg.OpExecutionContext,
        postgres: PostgresResource,
        embedding_provider: EmbeddingProviderResource,
        source: SourceDirectoryResource,
    ) -> Iterator[dg.AssetMaterialization | dg.Output]:
        started = time.monotonic()
        bucket_ids = _pending(context)
        rt = embedding_provider.runtime(dagster_run_id=context.run_id)
        # What the tick observed, read before the sync: a change observed later shows the bucket stale.
        observed = latest_observation(context.instance, SOURCE_FILES)
        try:
            src = source.source(rt.settings)
            done = bk.sync_buckets(rt, postgres.pool(), src, bucket_ids, n, observed=True)
        except (SourceError, bucket_rows.BucketCountMismatch) as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        context.log.info(
            f"synced {len(bucket_ids)} bucket(s) (no walk): {done.changed} changed, {done.stale} stale, "
            f"{done.gone} gone in {time.monotonic() - started:.2f} s"
        )
        with postgres.connection() as conn:
            states = bucket_rows.states_of(conn, src.key, bucket_ids, n)
        versions = code_versions(rt.settings)
        chunks = yield from ingest_materializations(
            context.instance, states, {b: {} for b in bucket_ids}, versions, observed
        )
        yield dg.Output(
            {
                "buckets": bucket_ids,
                "chunks": chunks,
                "source": observed,
                "root": src.key,
                "documents": done.documents,
                "states": states,
            },
            metadata={
                "buckets": len(bucket_ids),
                "files_read": done.scan.hashed,
                "changed_documents": done.changed,
                "stale_documents": done.stale,
                "gone_documents": done.gone,
                "duration_seconds": round(time.monotonic() - started, 3),
            },
        )

    @dg.op(
        name=EMBED_OP,
        pool=concurrency_pool,
        description="Embed the synced buckets for every active model; record their cells and checks.",
    )
    def embed_synced(
        context: dg.OpExecutionContext,
        synced: dict,
        postgres: PostgresResource,
        embedding_provider: EmbeddingProviderResource,
        embedding_run: EmbeddingRunResource,
    ) -> Iterator[dg.AssetMaterialization | dg.AssetObservation | dg.AssetCheckEvaluation | dg.Output]:
        started = time.monotonic()
        bucket_ids: list[int] = synced["buckets"]
        root: str = synced["root"]
        # The documents the sync ingested, recorded or tombstoned (None: too many to list): their
        # chunks alone are enqueued and waited for, then the buckets' coverage read once.
        documents: list[str] | None = synced.get("documents")
        settings = embedding_provider.settings()
        in_process = embedding_run.embeds_in_process(settings)
        db_pool = postgres.pool()
        models = _models(context.instance, model_admin.active_model_ids(db_pool))
        # The buckets' states as this run's sync left them (its chunks' materializations record the
        # same); read again only for the output of a run that did not pass them on.
        states: dict[int, bucket_rows.BucketState] | None = synced.get("states")
        if states is None:
            with postgres.connection() as conn:
                states = bucket_rows.states_of(conn, root, bucket_ids, n)
        code_version = code_versions(settings)["embeddings"]
        totals: dict[str, int] = {}
        for model_id in models:
            try:
                rt = model_runtime.runtime_of(settings, db_pool, model_id, dagster_run_id=context.run_id)
            except ConfigError as exc:
                raise dg.Failure(description=str(exc), allow_retries=False) from None
            est = preflight(context, rt, db_pool, root, bucket_ids, n, documents)
            done = embed_or_fail(
                rt, db_pool, root, bucket_ids, n, in_process, embedding_run, len(bucket_ids), documents
            )
            context.log.info(f"{model_id}: {len(bucket_ids)} bucket(s) embedded ({done.waited_seconds:.2f} s waited)")
            if done.index_put_off:
                context.log.info(done.index_put_off)
            cells = {str(embedding_key(b, model_id)): b for b in bucket_ids}
            inputs: dict[str, dict[dg.AssetKey, Any]] = {
                key: {CHUNKS: synced["chunks"][bucket_key(b)], SOURCE_FILES: synced["source"]}
                for key, b in cells.items()
                if bucket_key(b) in synced["chunks"]
            }
            covered = done.per_bucket
            events = {
                key: (coverage_metadata(covered[b]), embedding_version(model_id, states[b], covered[b]))
                for key, b in cells.items()
            }
            yield from versioned_events(context.instance, EMBEDDINGS, code_version, events, inputs)
            # The checks judge the coverage the cells record (the wait's last read): one snapshot, and no
            # second grouped read over every document of the buckets.
            for key, b in cells.items():
                yield coverage_evaluation(key, covered[b], model_id)
            for name, value in run_counts(est, done).items():
                totals[name] = totals.get(name, 0) + value
        yield dg.Output(
            None,
            metadata={
                "model": ", ".join(models),
                **totals,
                "buckets": len(bucket_ids),
                "in_process": in_process,
                "duration_seconds": round(time.monotonic() - started, 3),
            },
        )

    @dg.job(
        name=SYNC_EMBED_JOB_NAME,
        partitions_def=bucket_partitions(n),
        executor_def=dg.in_process_executor,
        description="The source sensor's run after a change: sync the buckets of its tag "
        "pipeline/pending_buckets from the tick's observations, then embed them for every active model; "
        "records their documents, chunks and embeddings cells (the rest of the range keeps what it had).",
    )
    def sync_and_embed() -> None:
        embed_synced(sync_pending())

    return sync_and_embed
