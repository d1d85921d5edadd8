"""Dagster assets: documents -> chunks -> embeddings, one partition per source document.

The partition key is the stable ``document_id`` (the path relative to the source
root). The assets are thin: each calls a use case of ``pipeline_assets.app``,
the same ones the command line calls.

* ``documents`` and ``chunks`` are ONE multi-asset (``ingest``) that cannot be
  subset: ``ingest_documents`` extracts, chunks and enqueues a document in one
  transaction, so they are always materialized together and neither can look
  stale against the other while the database is current.
* ``embeddings`` runs ``embed_documents``: it waits until the chunks of ITS
  partitions are ready or failed (not the whole queue), embedding them itself
  with a worker scoped to them (``in_process``) or leaving that to external
  ``work`` processes (``EmbeddingRunResource``), and fails with the counts at
  its deadline. In-process, it runs in the ``embedding_worker`` concurrency
  pool, so concurrent runs do not each start a worker fleet.
* ``embedding_store`` is not materialized by Dagster: the job table and the
  vectors search serves. Its health checks run on the schedule (``checks.py``).

Data versions, per partition: the sha256 of the extracted text (``documents``),
of the chunk checksums in order (``chunks``), of model, chunks and coverage
(``embeddings``); also in a run over many partitions (``partition_versions``).
Code versions: the extractor, the chunker, the model id. The per-format extractor
version is an upstream of ``documents``: the partitioned source asset
``extractor_version`` (``extractor_observations``), observed per partition. PostgreSQL stays the
source of truth; Dagster records what ran, with which code and data version.

Every asset has ``BackfillPolicy.single_run()``: a backfill of N partitions is
one run over a partition range, and the job table does the per-item work.
"""

import time
import warnings
from typing import Iterable, Iterator

import dagster as dg

from pipeline_assets.app import reports
from pipeline_assets.app.embed import EmbedDeadlineExceeded, EmbedIncomplete, embed_documents
from pipeline_assets.app.ingest import IngestReport, ingest_documents
from pipeline_assets.app.runtime import code_versions
from pipeline_assets.content.extract import ExtractorVersions
from pipeline_assets.content.sources import document_id_problem
from pipeline_assets.defs import extractor_observations as observe
from pipeline_assets.defs.extractor_observations import EXTRACTOR_VERSION
from pipeline_assets.defs.model_switch import refuse_model_override
from pipeline_assets.defs.partition_versions import PartitionVersion, digest, materialize
from pipeline_assets.defs.resources import (EmbeddingProviderResource, EmbeddingRunResource, PostgresResource,
                                             SourceDirectoryResource)
from pipeline_assets.jobs.worker import FatalProviderError
from pipeline_assets.settings import Settings

PARTITIONS_NAME = "documents"
DOCUMENT_PARTITIONS = dg.DynamicPartitionsDefinition(name=PARTITIONS_NAME)
GROUP = "embedding_pipeline"

DOCUMENTS = dg.AssetKey("documents")
CHUNKS = dg.AssetKey("chunks")
EMBEDDINGS = dg.AssetKey("embeddings")
ASSET_KEYS = (DOCUMENTS, CHUNKS, EMBEDDINGS)
EMBEDDING_STORE = dg.AssetKey("embedding_store")
INGEST_OP = "ingest"

# The Dagster concurrency pool of the embeddings step when it embeds in-process:
# its limit (deploy/dagster.yaml, `pipeline-assets dev`: 1) is how many runs may
# run a worker at once; the others' steps wait for the slot.
EMBEDDING_POOL = "embedding_worker"

# The embeddings run's scoped worker polls for claimable jobs of its documents
# this often (a retry coming due), instead of the CLI's 0.5 s; the run itself
# re-reads its documents' coverage every app.embed.WAIT_POLL_SECONDS.
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
    return document_id_problem(document_id)  # absolute, '..', hidden: could leave the source root


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


def _report_metadata(report: IngestReport) -> dict[str, int]:
    return {k: int(v) for k, v in report.as_dict().items() if isinstance(v, int)}


def _document_version(s: reports.DocumentSummary | None) -> PartitionVersion:
    """A document's data version: its text checksum (a quarantined one: why, and which bytes)."""
    if s is None:
        return PartitionVersion("absent", {"status": "absent"})
    meta = {"status": s.status, "text_checksum": s.text_checksum or "", "source_checksum": s.source_checksum or "",
            "extractor_version": s.extractor_version or ""}
    if s.error_class:
        meta["error_class"] = s.error_class
    return PartitionVersion(s.text_checksum or f"{s.status}:{s.error_class}:{s.source_checksum}", meta)


def ingest_versions(summaries: dict[str, reports.DocumentSummary], keys: Iterable[str],
                    extractor: ExtractorVersions | None = None,
                    ) -> tuple[dict[str, PartitionVersion], dict[str, PartitionVersion]]:
    """The documents and chunks versions of some partitions after an ingest (also a reconciliation's).

    ``extractor``: the current per-format versions, recorded as each document's
    ``extractor_version`` input (its format's version; see ``extractor_observations``).
    """
    docs, chunks = {}, {}
    for key in keys:
        s = summaries.get(key)
        docs[key] = _document_version(s)
        if extractor is not None:
            docs[key] = PartitionVersion(docs[key].data_version, docs[key].metadata,
                                         inputs={EXTRACTOR_VERSION: extractor.of(key)})
        meta = {"chunk_count": s.chunks, "tokens": s.tokens, "chunks_digest": s.chunks_digest} if s else {}
        chunks[key] = PartitionVersion(s.chunks_digest if s else "absent", meta,
                                       inputs={DOCUMENTS: docs[key].data_version})
    return docs, chunks


def build_assets(settings: Settings) -> list[dg.AssetsDefinition | dg.AssetSpec]:
    """The assets, with the code versions the settings give (extractor, chunker, model).

    A factory so that tests (and anything else changing PIPELINE_EXTRACTOR_VERSION
    or the model in-process) can build definitions that see the change.
    """
    # backfill_policy is "beta" in 1.13; it is the point of this layout, so no warning per asset.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*backfill_policy.*", category=dg.BetaWarning)
        pool = EMBEDDING_POOL if settings.embed_workers == "in-process" else None
        return [EXTRACTOR_VERSION_SPEC, *_build_assets(code_versions(settings), pool), EMBEDDING_STORE_SPEC]


EXTRACTOR_VERSION_SPEC = dg.AssetSpec(
    EXTRACTOR_VERSION, group_name=GROUP, partitions_def=DOCUMENT_PARTITIONS,
    description="Each document's extractor version: its format's (html, pdf, text), observed by the ingest "
                "step and the rerun sensor. A per-format bump re-observes only that format's partitions, "
                "so only their documents turn stale.")


EMBEDDING_STORE_SPEC = dg.AssetSpec(
    EMBEDDING_STORE, group_name=GROUP, kinds={"postgres"},
    description="The job table and the vectors search serves (app.embedding_jobs, app.embeddings). Not "
                "materialized by Dagster: its health checks (stale vectors, dead-letter growth) run on the "
                "pipeline_health_checks schedule, never in the runs that embed.")


def _build_assets(v: dict[str, str], pool: str | None = None) -> list[dg.AssetsDefinition]:
    common = dict(partitions_def=DOCUMENT_PARTITIONS, backfill_policy=dg.BackfillPolicy.single_run())
    spec = dict(group_name=GROUP, kinds={"postgres"})

    @dg.multi_asset(
        name=INGEST_OP, can_subset=False, **common,
        specs=[dg.AssetSpec(DOCUMENTS, deps=[EXTRACTOR_VERSION], code_version=v["documents"], **spec,
                            description="Source documents extracted to text. Materialized together with "
                                        "chunks (one ingest transaction). Data version: sha256 of the text."),
               dg.AssetSpec(CHUNKS, deps=[DOCUMENTS], code_version=v["chunks"], **spec,
                            description="Current chunks of each document in app.chunks, enqueued for "
                                        "embedding. Data version: sha256 of the chunk checksums in order.")])
    def ingest(context: dg.AssetExecutionContext, postgres: PostgresResource,
               embedding_provider: EmbeddingProviderResource,
               source: SourceDirectoryResource) -> Iterator[dg.MaterializeResult]:
        """Extract, chunk and enqueue the partitions' documents (unchanged ones are skipped)."""
        started = time.monotonic()
        keys = valid_partition_keys(context.partition_keys, context.log)
        rt = embedding_provider.runtime(run_id=context.run.run_id, force=context.run.tags.get(FORCE_TAG) == "true")
        root = source.root_path(rt.settings)
        report = ingest_documents(rt, postgres.pool(), root, keys) if keys else IngestReport()
        with postgres.connection() as conn:
            summaries = reports.document_summaries(conn, str(root), keys)
        docs, chunks = ingest_versions(summaries, keys, rt.options.extractor_version)
        # Observe versions not yet observed (a new partition, a bump) before recording provenance,
        # and make Dagster re-read the source's latest event for a one-partition run's own provenance.
        new = observe.changed(context.instance, {k: rt.options.extractor_version.of(k) for k in keys})
        if new:
            yield from observe.observation_events(context, new)
            context.get_step_execution_context().wipe_input_asset_version_info(EXTRACTOR_VERSION)
        run_meta = {"partitions": len(context.partition_keys),
                    "skipped_invalid_keys": len(context.partition_keys) - len(keys)}
        yield from materialize(context, [
            (DOCUMENTS, docs, {**_report_metadata(report), **run_meta, "source_root": str(root),
                               "duration_seconds": round(time.monotonic() - started, 3)}),
            (CHUNKS, chunks, {**run_meta, "chunks": sum(s.chunks for s in summaries.values()),
                              "tokens": sum(s.tokens for s in summaries.values())})])

    @dg.asset(name="embeddings", deps=[CHUNKS], code_version=v["embeddings"], pool=pool, **common, **spec,
              description="Vectors of the chunks for the configured model (app.embeddings). A run ends when "
                          "the chunks of its own partitions are ready or failed (a worker scoped to them "
                          "embeds them in the run, or external `work` processes do), or fails at its "
                          "deadline with the counts. Code version: the model id.")
    def embeddings(context: dg.AssetExecutionContext, postgres: PostgresResource,
                   embedding_provider: EmbeddingProviderResource, source: SourceDirectoryResource,
                   embedding_run: EmbeddingRunResource) -> Iterator[dg.MaterializeResult]:
        """Embed the partitions' chunks, first and only (the rest of the queue is others' work).

        The model id is this asset's code version: the vectors are a function of
        (chunk text, model), so changing the model marks every embeddings
        partition stale while documents and chunks stay fresh. Re-materializing
        is cheap where nothing changed: jobs are keyed by (chunk checksum,
        model), so only content without a vector for the model is sent.
        """
        started = time.monotonic()
        keys = valid_partition_keys(context.partition_keys, context.log)
        rt = embedding_provider.runtime(run_id=context.run.run_id)
        model_id = rt.model_id
        refuse_model_override(context, model_id)  # vectors and code version name the same model
        in_process = embedding_run.embeds_in_process(rt.settings)
        try:
            done = embed_documents(rt, postgres.pool(), source.root_path(rt.settings), keys,
                                   poll_seconds=WORKER_POLL_SECONDS, in_process=in_process,
                                   deadline_seconds=embedding_run.deadline(rt.settings))
        except FatalProviderError as exc:
            raise dg.Failure(description=f"embedding provider refused the configuration: {exc}",
                             allow_retries=False) from None
        except EmbedIncomplete as exc:  # the deadline passed, or the worker stopped (a token budget)
            cov = exc.coverage
            why = "deadline passed" if isinstance(exc, EmbedDeadlineExceeded) else "embedding stopped"
            raise dg.Failure(description=f"{why}: {exc}", allow_retries=isinstance(exc, EmbedDeadlineExceeded),
                             metadata={"chunks": cov.wanted, "ready": cov.ready, "failed": cov.failed,
                                       "outstanding": exc.outstanding, "partitions": len(keys),
                                       "in_process": in_process}) from None
        work, before, after = done.work, done.before, done.after
        versions = {}
        for key in keys:
            s, cov = done.summaries.get(key), done.per_document.get(key)
            chunks_version = s.chunks_digest if s else "absent"
            coverage = f"{cov.ready}/{cov.wanted}" if cov else "0/0"
            meta = {"chunks": cov.wanted, "ready": cov.ready, "failed": cov.failed} if cov else {"chunks": 0}
            versions[key] = PartitionVersion(digest(model_id, chunks_version, coverage), meta,
                                             inputs={CHUNKS: chunks_version})
        yield from materialize(context, [(EMBEDDINGS, versions, {
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
            "in_process": in_process,
            "waited_seconds": done.waited_seconds,
            "duration_seconds": round(time.monotonic() - started, 3),
        })])

    return [ingest, embeddings]
