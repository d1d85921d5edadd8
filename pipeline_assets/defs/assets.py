"""Dagster assets: documents -> chunks -> embeddings, one partition per source document.

The partition key is the stable ``document_id`` (the path relative to the source
root). The assets are thin: each calls a use case of ``pipeline_assets.app``,
the same ones the command line calls. ``documents`` runs ``ingest_documents``
(extract, chunk and enqueue in one transaction per batch), ``chunks`` reports
what the database holds (and re-chunks only documents produced by another
extractor/chunker version), ``embeddings`` runs ``embed_documents`` (the
in-process worker until the job table is idle). PostgreSQL stays the source of truth; Dagster records what
ran, with which code version and which data version.

Every asset has ``BackfillPolicy.single_run()``: a backfill of N partitions is
one run over a partition range, and the job table does the per-item work.
"""

import hashlib
import time
import warnings
from typing import Iterable, Sequence

import dagster as dg

from pipeline_assets.app import reports
from pipeline_assets.app.embed import embed_documents
from pipeline_assets.app.ingest import IngestReport, ingest_documents
from pipeline_assets.app.runtime import code_versions
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.jobs.worker import FatalProviderError
from pipeline_assets.settings import Settings

PARTITIONS_NAME = "documents"
DOCUMENT_PARTITIONS = dg.DynamicPartitionsDefinition(name=PARTITIONS_NAME)
GROUP = "embedding_pipeline"

DOCUMENTS = dg.AssetKey("documents")
CHUNKS = dg.AssetKey("chunks")
EMBEDDINGS = dg.AssetKey("embeddings")
ASSET_KEYS = (DOCUMENTS, CHUNKS, EMBEDDINGS)

# The embeddings run's worker polls the idle queue this often, so a run ends
# ~0.1 s after the job table is idle instead of the CLI's 0.5 s.
WORKER_POLL_SECONDS = 0.1

# Run tags set by the sensors. FORCE re-extracts even unchanged bytes (a rerun
# after a parser fix must also refresh quarantined documents).
FORCE_TAG = "pipeline/force"
RERUN_TAG = "pipeline/rerun"

# "|" separates the dimensions of multi-partition keys; the rest are refused by
# Dagster itself ("..." is its partition-range separator).
INVALID_KEY_PARTS = ("|", "...", "\n", "\r", "\t", "\0", "\a", "\b", "\f", "\v")


def partition_key_problem(document_id: str) -> str | None:
    """Why a document id cannot be a partition key, or None if it can."""
    if not document_id:
        return "empty document id"
    for part in INVALID_KEY_PARTS:
        if part in document_id:
            return f"contains {part!r}"
    return None


def valid_partition_keys(keys: Iterable[str], log) -> list[str]:
    """The keys usable as document ids; each refused one is logged once, clearly."""
    good = []
    for key in keys:
        problem = partition_key_problem(key)
        if problem:
            log.warning(f"skipping document {key!r}: {problem}; it cannot be a Dagster partition key "
                        "(rename the file, or let `pipeline-assets reconcile` handle it)")
        else:
            good.append(key)
    return good


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def _single(keys: Sequence[str]) -> str | None:
    return keys[0] if len(keys) == 1 else None


def _report_metadata(report: IngestReport) -> dict[str, int]:
    return {k: int(v) for k, v in report.as_dict().items() if isinstance(v, int)}


def _add_partition_metadata(context: dg.AssetExecutionContext, per_key: dict[str, dict],
                            settings: Settings) -> dict:
    """Metadata on each partition's own materialization event (its checksum, its counts).

    Dagster re-reads the run's whole partition list on every call, so this is
    quadratic in the partitions of a run: past PER_PARTITION_METADATA_MAX keys
    the per-document values stay in the database (the source of truth) and the
    run records a digest of them instead. Returns the run-level metadata to add.
    """
    if len(context.partition_keys) <= settings.partition_metadata_max:
        for key, meta in per_key.items():
            context.add_asset_metadata(meta, partition_key=key)
        return {}
    digest = _digest(*(f"{k}={sorted(m.items())}" for k, m in sorted(per_key.items())))
    return {"per_partition_digest": digest,
            "per_partition_metadata": f"omitted for {len(context.partition_keys)} partitions "
                                      f"(> {settings.partition_metadata_max}); per-document values are in "
                                      "app.documents / app.chunks"}


def build_assets(settings: Settings) -> list[dg.AssetsDefinition]:
    """The three assets, with the code versions the settings give (extractor, chunker, model).

    A factory so that tests (and anything else changing PIPELINE_EXTRACTOR_VERSION
    or the model in-process) can build definitions that see the change.
    """
    # backfill_policy is "beta" in 1.13; it is the point of this layout, so no warning per asset.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*backfill_policy.*", category=dg.BetaWarning)
        return _build_assets(code_versions(settings))


def _build_assets(v: dict[str, str]) -> list[dg.AssetsDefinition]:
    common = dict(partitions_def=DOCUMENT_PARTITIONS, backfill_policy=dg.BackfillPolicy.single_run(),
                  group_name=GROUP, kinds={"postgres"})

    @dg.asset(name="documents", code_version=v["documents"], **common,
              description="Source documents extracted to text (and chunked and enqueued by the same "
                          "ingest transaction). Data version: sha256 of the extracted text.")
    def documents(context: dg.AssetExecutionContext, postgres: PostgresResource,
                  embedding_provider: EmbeddingProviderResource,
                  source: SourceDirectoryResource) -> dg.MaterializeResult:
        started = time.monotonic()
        keys = valid_partition_keys(context.partition_keys, context.log)
        rt = embedding_provider.runtime(run_id=context.run.run_id, force=context.run.tags.get(FORCE_TAG) == "true")
        root = source.root_path(rt.settings)
        report = ingest_documents(rt, postgres.pool(), root, keys) if keys else IngestReport()
        with postgres.connection() as conn:
            summaries = reports.document_summaries(conn, str(root), keys)
        data_versions = {}
        per_partition: dict[str, dict] = {}
        for key in keys:
            s = summaries.get(key)
            if s is None:
                meta = {"status": "absent"}
                data_versions[key] = "absent"
            else:
                meta = {"status": s.status, "text_checksum": s.text_checksum or "",
                        "source_checksum": s.source_checksum or ""}
                if s.error_class:
                    meta["error_class"] = s.error_class
                data_versions[key] = s.text_checksum or f"{s.status}:{s.error_class}:{s.source_checksum}"
            per_partition[key] = meta
        metadata = {**_add_partition_metadata(context, per_partition, rt.settings), **_report_metadata(report),
                    "partitions": len(context.partition_keys),
                    "skipped_invalid_keys": len(context.partition_keys) - len(keys),
                    "duration_seconds": round(time.monotonic() - started, 3), "source_root": str(root)}
        one = _single(keys)
        return dg.MaterializeResult(metadata=metadata,
                                    data_version=dg.DataVersion(data_versions[one]) if one else None)

    @dg.asset(name="chunks", deps=[documents], code_version=v["chunks"], **common,
              description="Current chunks of each document in app.chunks. Data version: sha256 of the "
                          "chunk checksums in order. Re-chunks documents made by other code versions.")
    def chunks(context: dg.AssetExecutionContext, postgres: PostgresResource,
               embedding_provider: EmbeddingProviderResource,
               source: SourceDirectoryResource) -> dg.MaterializeResult:
        started = time.monotonic()
        keys = valid_partition_keys(context.partition_keys, context.log)
        rt = embedding_provider.runtime(run_id=context.run.run_id)
        root = source.root_path(rt.settings)
        wanted = (rt.options.extractor_version, rt.options.chunker.version)
        with postgres.connection() as conn:
            summaries = reports.document_summaries(conn, str(root), keys)
        # Normally `documents` just did the work; materialized alone after a
        # chunker change, this asset brings the partition up to date itself.
        todo = [k for k in keys if k not in summaries or (
            summaries[k].status != "deleted"
            and (summaries[k].extractor_version, summaries[k].chunker_version) != wanted)]
        if todo:
            ingest_documents(rt, postgres.pool(), root, todo)
            with postgres.connection() as conn:
                summaries = reports.document_summaries(conn, str(root), keys)
        per_partition = {key: {"chunk_count": s.chunks, "chunks_digest": s.chunks_digest}
                         for key, s in summaries.items()}
        metadata = {**_add_partition_metadata(context, per_partition, rt.settings),
                    "chunks": sum(s.chunks for s in summaries.values()),
                    "tokens": sum(s.tokens for s in summaries.values()),
                    "rechunked": len(todo), "partitions": len(context.partition_keys),
                    "duration_seconds": round(time.monotonic() - started, 3)}
        one = _single(keys)
        version = None
        if one:
            version = summaries[one].chunks_digest if one in summaries else "absent"
        return dg.MaterializeResult(metadata=metadata,
                                    data_version=dg.DataVersion(version) if version else None)

    @dg.asset(name="embeddings", deps=[chunks], code_version=v["embeddings"], **common,
              description="Vectors of the chunks for the configured model (app.embeddings), made by the "
                          "in-process worker. Code version: the model id.")
    def embeddings(context: dg.AssetExecutionContext, postgres: PostgresResource,
                   embedding_provider: EmbeddingProviderResource,
                   source: SourceDirectoryResource) -> dg.MaterializeResult:
        """Embed the partition's chunks (and anything else waiting in the job table).

        The model id is this asset's code version. One model is active at a time,
        chosen by the environment (PIPELINE_EMBEDDING_MODEL, OPENAI_API_KEY), and
        the vectors are a function of (chunk text, model): the model is the code
        that turns the upstream data into this asset. Changing the model is
        therefore a code-version change, and Dagster marks every embeddings
        partition stale until it is re-materialized with the new model, while
        documents and chunks stay fresh. Re-materializing is cheap where nothing
        changed: jobs are keyed by (chunk checksum, model), so only content
        without a vector for the new model is sent to the provider.
        """
        started = time.monotonic()
        keys = valid_partition_keys(context.partition_keys, context.log)
        rt = embedding_provider.runtime(run_id=context.run.run_id)
        model_id = rt.model_id
        try:
            done = embed_documents(rt, postgres.pool(), source.root_path(rt.settings), keys,
                                   poll_seconds=WORKER_POLL_SECONDS)
        except FatalProviderError as exc:
            raise dg.Failure(description=f"embedding provider refused the configuration: {exc}",
                             allow_retries=False) from None
        work, summaries, before, after, per_doc = done.work, done.summaries, done.before, done.after, done.per_document
        per_partition = {key: {"chunks": c.wanted, "ready": c.ready, "failed": c.failed}
                         for key, c in per_doc.items()}
        metadata = {
            **_add_partition_metadata(context, per_partition, rt.settings),
            "model": model_id,
            "chunks": after.wanted,
            "embedded": work.embedded,
            "reused": before.ready,
            "superseded": work.superseded,
            "failed": after.failed,
            "waiting": after.waiting,
            "enqueued": done.enqueued,
            "retried": work.retried,
            "throttled": work.throttled,
            "provider_calls": work.provider_calls,
            "tokens": work.tokens,
            "coverage_ratio": round(after.ready / after.wanted, 6) if after.wanted else 1.0,
            "partitions": len(context.partition_keys),
            "duration_seconds": round(time.monotonic() - started, 3),
        }
        one = _single(keys)
        version = None
        if one:
            s = summaries.get(one)
            cov = per_doc.get(one)
            version = _digest(model_id, s.chunks_digest if s else "absent",
                              f"{cov.ready}/{cov.wanted}" if cov else "0/0")
        return dg.MaterializeResult(metadata=metadata,
                                    data_version=dg.DataVersion(version) if version else None)

    return [documents, chunks, embeddings]
