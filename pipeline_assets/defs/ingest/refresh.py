"""``refresh_documents``: single documents re-materialized through run config.

Partitions are buckets, so a document is selected by run config (``RefreshConfig``:
``document_ids`` and/or a ``glob`` over the source's ids, ``force``; docs/dagster.md, "Jobs").
The run ingests exactly those documents (a file gone is tombstoned), records them as synced
in the source sensor's observations, embeds their chunks (only content without a vector is
sent) and records, per bucket touched, a ``documents``, ``chunks`` and ``embeddings``
(bucket x the configured model) materialization with the refreshed ids and the versions an
asset run of the bucket would record (``provenance``), so Dagster's staleness stays true.
"""

import fnmatch
from collections.abc import Iterator
from typing import Any

import dagster as dg

from pipeline_assets.app import buckets as bk
from pipeline_assets.app.embed_selection import embed_and_wait
from pipeline_assets.app.ingest import ingest_documents
from pipeline_assets.app.runtime import code_versions
from pipeline_assets.app.vector_wait import EmbedIncomplete
from pipeline_assets.content.source import Source, SourceError
from pipeline_assets.defs.embeddings.assets import refused_as_failure
from pipeline_assets.defs.embeddings.records import embedding_version
from pipeline_assets.defs.ingest.assets import ingest_materializations
from pipeline_assets.defs.keys import CHUNKS, EMBEDDINGS, SOURCE_FILES
from pipeline_assets.defs.partitions import MODEL_PARTITIONS_NAME, embedding_key, is_model_key
from pipeline_assets.defs.provenance import latest_observation, versioned_events
from pipeline_assets.defs.resources import (
    EmbeddingProviderResource,
    EmbeddingRunResource,
    PostgresResource,
    SourceDirectoryResource,
)
from pipeline_assets.store import bucket_rows, source_observations

REFRESH_JOB_NAME = "refresh_documents"
REFRESH_OP_NAME = "refresh_documents_op"
# Documents one refresh run may select (a glob that matches the whole corpus is a backfill's job).
MAX_REFRESH_DOCUMENTS = 10_000


class RefreshConfig(dg.Config):
    document_ids: list[str] = []  # noqa: RUF012 (pydantic copies the default)
    # ids as the source names them (a folder's: paths relative to its root)
    glob: str = ""  # fnmatch pattern over the source's document ids ("*" crosses "/")
    force: bool = False  # re-extract even if bytes and code versions are unchanged


def select_documents(source: Source, document_ids: list[str], glob: str) -> list[str]:
    """The ids asked for, then those of the source's items the glob matches, each once."""
    for doc in document_ids:
        if problem := source.id_problem(doc):
            raise dg.Failure(description=f"document id {doc!r}: {problem}", allow_retries=False)
    chosen = dict.fromkeys(document_ids)
    if glob:
        try:
            matched = sorted(doc for doc, *_ in source.observe() if fnmatch.fnmatchcase(doc, glob))
            chosen.update(dict.fromkeys(matched))
        except SourceError as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
    if not chosen:
        raise dg.Failure(
            description=f"nothing to refresh: no document_ids given and glob {glob!r} matches no "
            f"file (item) of {source.describe()}",
            allow_retries=False,
        )
    if len(chosen) > MAX_REFRESH_DOCUMENTS:
        raise dg.Failure(
            description=f"{len(chosen)} documents selected (at most {MAX_REFRESH_DOCUMENTS}); "
            "backfill their buckets instead",
            allow_retries=False,
        )
    return list(chosen)


@dg.op(name=REFRESH_OP_NAME, description="Ingest and embed the documents the run config names (ids or a glob).")
def refresh_documents_op(
    context: dg.OpExecutionContext,
    config: RefreshConfig,
    postgres: PostgresResource,
    embedding_provider: EmbeddingProviderResource,
    source: SourceDirectoryResource,
    embedding_run: EmbeddingRunResource,
) -> Iterator[dg.AssetMaterialization | dg.Output]:
    rt = embedding_provider.runtime(dagster_run_id=context.run_id, force=config.force)
    try:
        src = source.source(rt.settings)
    except SourceError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    root = src.key
    ids = select_documents(src, config.document_ids, config.glob)
    db_pool = postgres.pool()
    n = postgres.bucket_count(rt.settings.partition_buckets)
    report = ingest_documents(rt, db_pool, src, ids)
    with postgres.connection() as conn:  # the source sensor's next scan finds them synced, not pending
        source_observations.mark_synced_as_stored(conn, root, ids)
    try:
        with refused_as_failure():
            done = embed_and_wait(
                rt,
                db_pool,
                root,
                ids,
                in_process=embedding_run.embeds_in_process(rt.settings),
                deadline_seconds=embedding_run.deadline(rt.settings),
            )
    except EmbedIncomplete as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    if done.index_put_off:
        context.log.info(done.index_put_off)
    touched = bk.buckets_of(ids, n)
    with postgres.connection() as conn:
        states = bucket_rows.states_of(conn, root, list(touched), n)
        bucket_cov = bucket_rows.coverage_of_buckets(conn, root, list(touched), n, rt.model_id)
    coverage = bk.bucket_coverage(done.per_document, list(touched), n)
    refreshed: dict[int, dict[str, Any]] = {
        b: {"refreshed_documents": ", ".join(docs[: bucket_rows.SAMPLE_IDS]), "refreshed_count": len(docs)}
        for b, docs in touched.items()
    }
    versions = code_versions(rt.settings)
    chunks = yield from ingest_materializations(context.instance, states, refreshed, versions)
    observed = latest_observation(context.instance, SOURCE_FILES)
    if rt.model_id not in context.instance.get_dynamic_partitions(MODEL_PARTITIONS_NAME) and is_model_key(rt.model_id):
        context.instance.add_dynamic_partitions(MODEL_PARTITIONS_NAME, [rt.model_id])  # its column, at once
    yield from versioned_events(
        context.instance,
        EMBEDDINGS,
        versions["embeddings"],
        {
            embedding_key(b, rt.model_id): (
                {
                    "model": rt.model_id,
                    "refreshed_chunks": coverage[b].chunks,
                    "ready": coverage[b].ready,
                    "failed": coverage[b].failed,
                    **more,
                },
                embedding_version(rt.model_id, states[b], bucket_cov[b]),
            )
            for b, more in sorted(refreshed.items())
        },
        {embedding_key(key, rt.model_id): {CHUNKS: chunks[key], SOURCE_FILES: observed} for key in chunks},
    )
    yield dg.Output(
        ids,
        metadata={
            **{k: v for k, v in report.as_dict().items() if isinstance(v, int)},
            "documents": len(ids),
            "buckets": len(touched),
            "embedded": done.work.embedded,
            "provider_calls": done.work.provider_calls,
            **({"vector_index": done.index_put_off} if done.index_put_off else {}),
        },
    )


@dg.job(
    name=REFRESH_JOB_NAME,
    executor_def=dg.in_process_executor,
    description="Re-materialize single documents given by run config (document_ids and/or a glob): ingest, "
    "embed, and a materialization per bucket touched.",
)
def refresh_job() -> None:
    refresh_documents_op()
