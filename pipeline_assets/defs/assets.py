"""Dagster assets: documents -> chunks by document bucket, embeddings by bucket x model.

A partition is a bucket of documents (``defs/partitions.py``): a stable hash of
``document_id`` modulo a count fixed in the database, so Dagster keeps a few
dozen partitions at any corpus size and an edited document stays in its
bucket. The assets are thin: each calls a use case of ``pipeline_assets.app``,
the same ones the command line calls.

* ``documents`` and ``chunks`` are ONE multi-asset (``ingest``) that cannot be
  subset: ``app.buckets.sync_buckets`` brings its buckets current with the
  source and the code (new and changed files ingested, stale documents
  re-extracted, gone ones tombstoned; unchanged files are not even read) in
  the ingest transactions that write both. A run of the rerun sensor (tag
  ``pipeline/rerun``) re-extracts the stale documents only: it does not scan
  the source, whose changes are the source sensor's run.
* ``embeddings`` is partitioned by bucket x model (one column per active model of the
  registry) and mapped to ``chunks`` by its bucket. Per model of its partition keys, it
  runs the use case ``app.embed.embed_buckets`` over the buckets' current documents:
  it waits until their chunks are ready or failed for that model (not the whole queue),
  embedding them itself (``in_process``) or leaving that to external ``work``
  processes (``EmbeddingRunResource``), and fails with the counts at its
  deadline. In-process, it runs in the ``embedding_worker`` concurrency pool. Its first
  action per model, before anything is enqueued or sent, is the preflight: what the run
  would send (``app.estimate``), logged and recorded as an observation of ``embeddings``.
* ``embedding_store`` is not materialized by Dagster: the job table and the
  vectors search serves. Its health checks run on the schedule (``checks.py``).

Per partition, each materialization carries its bucket's counts and the ids of
its quarantined or failed documents (bounded: ``app.buckets.SAMPLE_IDS``),
through Dagster's public per-partition metadata (``add_asset_metadata``).
Data versions: a one-bucket run records the bucket's own (a digest of its
documents' text checksums, of their chunk digests, of model and coverage); a
run over a range of buckets records one version for the range (Dagster 1.13
has one data version per result, dagster#18649), and each partition's own
digest is in its metadata. Code versions: the extractor versions of every
format, the chunker, ``vectors-1`` (the model is a partition, not code); a bump
marks every bucket stale, and the rerun sensor's run re-extracts only the stale
documents in them.

Every asset has ``BackfillPolicy.single_run()``: a backfill of N buckets is one
run per partitions definition (and per model for embeddings: Dagster groups a
multi-partition subset by model), and the job table does the per-item work.
"""

import hashlib
import time
import warnings
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import dagster as dg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import buckets as bk
from pipeline_assets.app import estimate, model_admin
from pipeline_assets.app.embed import BucketsEmbedded, EmbedDeadlineExceeded, EmbedIncomplete, embed_buckets
from pipeline_assets.app.ingest import IngestReport
from pipeline_assets.app.runtime import Runtime, code_versions
from pipeline_assets.defs.keys import CHUNKS, DOCUMENTS, EMBEDDING_STORE
from pipeline_assets.defs.partitions import (
    BUCKET_DIMENSION,
    bucket_indexes,
    bucket_key,
    bucket_partitions,
    embedding_key,
    embedding_partitions,
    keys_by_model,
)
from pipeline_assets.defs.provenance import versioned_events
from pipeline_assets.defs.resources import (
    EmbeddingProviderResource,
    EmbeddingRunResource,
    PostgresResource,
    SourceDirectoryResource,
)
from pipeline_assets.jobs.worker import FatalProviderError
from pipeline_assets.providers import ConfigError
from pipeline_assets.settings import Settings

GROUP = "embedding_pipeline"

INGEST_OP = "ingest"

# The Dagster concurrency pool of the embeddings step when it embeds in-process:
# its limit (dagster.yaml, `pipeline-assets dev`: 1) is how many runs may run a
# worker at once; the others' steps wait for the slot.
EMBEDDING_POOL = "embedding_worker"

# The embeddings run's worker polls for claimable jobs this often (a retry
# coming due), instead of the CLI's 0.5 s.
WORKER_POLL_SECONDS = 0.1

# Run tags set by the sensors.
RERUN_TAG = "pipeline/rerun"


def run_version(versions: Mapping[str, str]) -> str:
    """One partition's version, or the version of a range (never mistaken for one bucket's)."""
    if len(versions) == 1:
        return next(iter(versions.values()))
    h = hashlib.sha256()
    for key in sorted(versions):
        h.update(f"{key}={versions[key]}\x1e".encode())
    return f"range:{len(versions)}:{h.hexdigest()[:16]}"


def _counts(report: IngestReport) -> dict[str, int]:
    return {k: int(v) for k, v in report.as_dict().items() if isinstance(v, int)}


def document_metadata(state: bk.BucketState) -> dict[str, Any]:
    meta: dict[str, Any] = {"documents": state.documents, "current": state.current, "quarantined": state.quarantined,
                  "text_digest": state.text_digest}
    if state.quarantined_ids:
        meta["quarantined_ids"] = ", ".join(state.quarantined_ids)
    return meta


def chunk_metadata(state: bk.BucketState) -> dict[str, Any]:
    return {"chunk_count": state.chunks, "tokens": state.tokens, "chunks_digest": state.chunks_digest}


def embedding_version(model_id: str, state: bk.BucketState, cov: bk.BucketCoverage) -> str:
    """One ``embeddings`` partition's data version: the model, the bucket's chunks, its coverage."""
    return bk.digest([model_id, state.chunks_digest, f"{cov.ready}/{cov.chunks}"])


def ingest_materializations(instance: dg.DagsterInstance, states: Mapping[int, bk.BucketState],
                            extra: Mapping[int, dict], versions: Mapping[str, str],
                            ) -> Generator[dg.AssetMaterialization, None, dict[str, tuple[str, int]]]:
    """A ``documents`` and a ``chunks`` materialization for each bucket of ``extra`` (its own
    metadata added), from a step that does not own them (reconciliation, refresh_documents),
    with the data and code versions an asset run records (``provenance``). Returns each
    bucket's chunks (data version, storage id): the input of its ``embeddings``."""
    docs = yield from versioned_events(instance, DOCUMENTS, versions["documents"], {
        bucket_key(b): ({**document_metadata(states[b]), **more}, states[b].text_digest)
        for b, more in sorted(extra.items())})
    return (yield from versioned_events(instance, CHUNKS, versions["chunks"], {
        bucket_key(b): ({**chunk_metadata(states[b]), **more}, states[b].chunks_digest)
        for b, more in sorted(extra.items())},
        {key: {DOCUMENTS: docs[key]} for key in docs}))


def _embed(rt: Runtime, pool: ConnectionPool, root: str, buckets: list[int], n: int, in_process: bool,
           embedding_run: EmbeddingRunResource, partitions: int) -> BucketsEmbedded:
    """One model's part of an embeddings run: ``embed_buckets``, its failures as Dagster's."""
    try:
        return embed_buckets(rt, pool, root, buckets, n, poll_seconds=WORKER_POLL_SECONDS,
                             in_process=in_process, deadline_seconds=embedding_run.deadline(rt.settings))
    except FatalProviderError as exc:
        raise dg.Failure(description=f"embedding provider refused the configuration: {exc}",
                         allow_retries=False) from None
    except ConfigError as exc:  # the model's window unknown, or the chunks too large for it
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    except EmbedIncomplete as exc:  # the deadline passed, or the worker stopped (a token budget)
        cov = exc.coverage
        why = "deadline passed" if isinstance(exc, EmbedDeadlineExceeded) else "embedding stopped"
        raise dg.Failure(description=f"{why}: {exc}", allow_retries=isinstance(exc, EmbedDeadlineExceeded),
                         metadata={"chunks": cov.wanted, "ready": cov.ready, "failed": cov.failed,
                                   "outstanding": exc.outstanding, "partitions": partitions,
                                   "in_process": in_process, "model": rt.model_id}) from None


def _preflight(context: dg.AssetExecutionContext, rt: Runtime, pool: ConnectionPool, root: str,
               buckets: list[int], n: int) -> estimate.Estimate:
    """Before one model's part of an embeddings run enqueues or sends anything: what it would send
    (``app.estimate.for_buckets``), logged and recorded as an observation of the asset, so the run's
    event log and the asset's page show it while the run is still to spend."""
    est = estimate.for_buckets(pool, rt.provider.spec, rt.settings.price_per_million_tokens, root, buckets, n)
    context.log.info(f"preflight: {est.describe()}")
    context.log_event(dg.AssetObservation(
        asset_key=context.asset_key, description="preflight: what this run would send",
        metadata={"preflight": True, "buckets": len(buckets), **{k: v for k, v in est.as_dict().items()
                                                                 if v is not None}}))
    return est


def build_assets(settings: Settings) -> list[dg.AssetsDefinition | dg.AssetSpec]:
    """The assets, with the code versions and bucket count the settings give.

    A factory so that tests (and anything else changing PIPELINE_EXTRACTOR_VERSION
    or the model in-process) can build definitions that see the change.
    """
    # backfill_policy and the multi-to-single mapping are "beta" in 1.13; they are the point of this
    # layout, so no warning per asset.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*backfill_policy.*", category=dg.BetaWarning)
        warnings.filterwarnings("ignore", message=".*MultiToSingleDimensionPartitionMapping.*",
                                category=dg.BetaWarning)
        pool = EMBEDDING_POOL if settings.embed_workers == "in-process" else None
        return [*_build_assets(code_versions(settings), settings.partition_buckets, pool), EMBEDDING_STORE_SPEC]


EMBEDDING_STORE_SPEC = dg.AssetSpec(
    EMBEDDING_STORE, group_name=GROUP, kinds={"postgres"},
    description="The job table and the vectors search serves (app.embedding_jobs, app.embeddings). Not "
                "materialized by Dagster: its health checks (stale vectors, dead-letter growth) run on the "
                "pipeline_health_checks schedule, never in the runs that embed.")


def _build_assets(v: dict[str, str], n: int, pool: str | None = None) -> list[dg.AssetsDefinition]:
    common: dict[str, Any] = dict(partitions_def=bucket_partitions(n), backfill_policy=dg.BackfillPolicy.single_run())
    spec: dict[str, Any] = dict(group_name=GROUP, kinds={"postgres"})

    @dg.multi_asset(
        name=INGEST_OP, can_subset=False, **common,
        specs=[dg.AssetSpec(DOCUMENTS, code_version=v["documents"], **spec,
                            description="Source documents extracted to text, by bucket of document ids. "
                                        "Materialized together with chunks. Code version: the extractor "
                                        "version of every format; per partition: its counts, its "
                                        "quarantined ids and a digest of its documents' text."),
               dg.AssetSpec(CHUNKS, deps=[DOCUMENTS], code_version=v["chunks"], **spec,
                            description="Current chunks of each bucket's documents in app.chunks, enqueued "
                                        "for embedding. Per partition: chunk and token counts, a digest.")])
    def ingest(context: dg.AssetExecutionContext, postgres: PostgresResource,
               embedding_provider: EmbeddingProviderResource,
               source: SourceDirectoryResource) -> Iterator[dg.MaterializeResult]:
        """Bring the buckets current: changed and stale documents only; unchanged files are not read."""
        started = time.monotonic()
        keys = list(context.partition_keys)
        buckets = bucket_indexes(keys)
        rt = embedding_provider.runtime(run_id=context.run.run_id)
        src = source.source(rt.settings)
        root = src.key
        try:
            # A rerun after a code fix re-extracts the stale documents only; source changes are the source
            # sensor's run (a backfill or a "materialize" from the UI does both).
            done = bk.sync_buckets(rt, postgres.pool(), src, buckets, n,
                                   source_changes=RERUN_TAG not in context.run.tags)
        except bk.BucketCountMismatch as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        with postgres.connection() as conn:
            states = bk.states_of(conn, root, buckets, n)
        for b, state in states.items():
            context.add_asset_metadata(document_metadata(state), asset_key=DOCUMENTS, partition_key=bucket_key(b))
            context.add_asset_metadata(chunk_metadata(state), asset_key=CHUNKS, partition_key=bucket_key(b))
        run_meta: dict[str, Any] = {"partitions": len(keys), "source": src.describe(), "source_root": root,
                    "source_kind": src.kind, "files_read": done.scan.hashed,
                    "changed_documents": done.changed, "stale_documents": done.stale,
                    "gone_documents": done.gone}
        yield dg.MaterializeResult(
            asset_key=DOCUMENTS, data_version=dg.DataVersion(run_version(
                {bucket_key(b): s.text_digest for b, s in states.items()})),
            metadata={**_counts(done.report), **run_meta, "duration_seconds": round(time.monotonic() - started, 3)})
        yield dg.MaterializeResult(
            asset_key=CHUNKS, data_version=dg.DataVersion(run_version(
                {bucket_key(b): s.chunks_digest for b, s in states.items()})),
            metadata={"partitions": len(keys), "chunks": sum(s.chunks for s in states.values()),
                      "tokens": sum(s.tokens for s in states.values())})

    @dg.asset(name="embeddings", code_version=v["embeddings"], pool=pool,
              partitions_def=embedding_partitions(n), backfill_policy=dg.BackfillPolicy.single_run(),
              deps=[dg.AssetDep(CHUNKS, partition_mapping=dg.MultiToSingleDimensionPartitionMapping(
                  partition_dimension_name=BUCKET_DIMENSION))], **spec,
              description="Vectors of the buckets' chunks, per bucket x model (app.embeddings): one column per "
                          "active model of the registry. A run ends when the chunks of its own buckets are ready "
                          "or failed for its models (a worker in the run embeds them, or external `work` "
                          "processes do), or fails at its deadline with the counts. Per partition: coverage "
                          "and failed document ids.")
    def embeddings(context: dg.AssetExecutionContext, postgres: PostgresResource,
                   embedding_provider: EmbeddingProviderResource, source: SourceDirectoryResource,
                   embedding_run: EmbeddingRunResource) -> dg.MaterializeResult:
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
        pool = postgres.pool()
        with postgres.connection() as conn:
            try:
                bk.check_buckets(conn, n)
            except bk.BucketCountMismatch as exc:
                raise dg.Failure(description=str(exc), allow_retries=False) from None
        versions: dict[str, str] = {}
        totals: dict[str, int] = {}
        documents = 0
        waited = 0.0
        for model_id, buckets in per_model.items():
            try:
                rt = model_admin.runtime_of(settings, pool, model_id, run_id=context.run.run_id)
            except ConfigError as exc:
                raise dg.Failure(description=str(exc), allow_retries=False) from None
            est = _preflight(context, rt, pool, root, buckets, n)
            done = _embed(rt, pool, root, buckets, n, in_process, embedding_run, len(keys))
            with postgres.connection() as conn:
                states = bk.states_of(conn, root, buckets, n)
            for b in buckets:
                bucket_cov, key = done.per_bucket[b], embedding_key(b, model_id)
                versions[key] = embedding_version(model_id, states[b], bucket_cov)
                meta: dict[str, Any] = {"chunks": bucket_cov.chunks, "ready": bucket_cov.ready,
                                        "failed": bucket_cov.failed, "waiting": bucket_cov.waiting}
                if bucket_cov.failed_ids:
                    meta["failed_ids"] = ", ".join(bucket_cov.failed_ids)
                context.add_asset_metadata(meta, partition_key=key)
            work, after = done.work, done.after
            for name, value in (("estimated_inputs", est.send_inputs), ("estimated_tokens", est.send_tokens),
                                ("chunks", after.wanted), ("embedded", work.embedded),
                                ("reused", max(after.ready - work.embedded, 0)),   # ready vectors this run did not make
                                ("superseded", work.superseded), ("failed", after.failed),
                                ("waiting", after.waiting), ("enqueued", done.enqueued), ("retried", work.retried),
                                ("throttled", work.throttled), ("provider_calls", work.provider_calls),
                                ("tokens", work.tokens), ("ready", after.ready)):
                totals[name] = totals.get(name, 0) + int(value)
            documents = max(documents, sum(state.documents for state in states.values()))
            waited += done.waited_seconds
        ready = totals.pop("ready", 0)
        return dg.MaterializeResult(data_version=dg.DataVersion(run_version(versions)), metadata={
            "model": ", ".join(per_model),
            **totals,
            "coverage_ratio": round(ready / totals["chunks"], 6) if totals.get("chunks") else 1.0,
            "partitions": len(keys),
            "documents": documents,
            "in_process": in_process,
            "waited_seconds": round(waited, 3),
            "duration_seconds": round(time.monotonic() - started, 3),
        })

    return [ingest, embeddings]
