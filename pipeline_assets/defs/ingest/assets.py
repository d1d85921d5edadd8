"""The ``ingest`` multi-asset: ``documents`` and ``chunks`` by document bucket, never subset.

Per run, ``app.buckets.sync_buckets`` brings its buckets current with the source and the
code: new and changed files ingested, stale documents re-extracted, gone ones tombstoned,
unchanged files not read. A run tagged ``pipeline/rerun`` (the rerun sensor's) re-extracts
the stale documents only and does not scan the source (the source sensor's runs after a change are
``sync_and_embed``'s, ``sync_and_embed.py``). Per partition it records its counts,
quarantined ids (at most ``store.bucket_rows.SAMPLE_IDS``) and digests; a one-bucket run records
the bucket's data version, a range run one version for the range (``provenance.run_version``).
Code versions: the extractor version of every format, and the chunker's.
"""

import time
import warnings
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import dagster as dg

from pipeline_assets.app import buckets as bk
from pipeline_assets.app.ingest_batches import IngestReport
from pipeline_assets.defs.keys import CHUNKS, DOCUMENTS, GROUP, SOURCE_FILES
from pipeline_assets.defs.partitions import bucket_indexes, bucket_key, bucket_partitions
from pipeline_assets.defs.provenance import latest_observation, run_version, versioned_events
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.defs.run_requests import RERUN_TAG
from pipeline_assets.store import bucket_rows

INGEST_OP = "ingest"


def _counts(report: IngestReport) -> dict[str, int]:
    return {k: int(v) for k, v in report.as_dict().items() if isinstance(v, int)}


def document_metadata(state: bucket_rows.BucketState) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "documents": state.documents,
        "current": state.current,
        "quarantined": state.quarantined,
        "text_digest": state.text_digest,
    }
    if state.quarantined_ids:
        meta["quarantined_ids"] = ", ".join(state.quarantined_ids)
    return meta


def chunk_metadata(state: bucket_rows.BucketState) -> dict[str, Any]:
    return {"chunk_count": state.chunks, "tokens": state.tokens, "chunks_digest": state.chunks_digest}


def ingest_materializations(
    instance: dg.DagsterInstance,
    states: Mapping[int, bucket_rows.BucketState],
    extra: Mapping[int, dict],
    versions: Mapping[str, str],
    source: tuple[str, int | None] | None = None,
) -> Generator[dg.AssetMaterialization, None, dict[str, tuple[str, int]]]:
    """A ``documents`` and a ``chunks`` materialization for each bucket of ``extra`` (its own
    metadata added), from a step that does not own them (reconciliation, refresh_documents,
    sync_and_embed), with the data and code versions an asset run records (``provenance``;
    ``source``: the ``source_files`` observation synced from, default the latest). Returns each
    bucket's chunks (data version, storage id): the input of its ``embeddings``."""
    source = source or latest_observation(instance, SOURCE_FILES)
    docs = yield from versioned_events(
        instance,
        DOCUMENTS,
        versions["documents"],
        {
            bucket_key(b): ({**document_metadata(states[b]), **more}, states[b].text_digest)
            for b, more in sorted(extra.items())
        },
        {bucket_key(b): {SOURCE_FILES: source} for b in extra},
    )
    return (
        yield from versioned_events(
            instance,
            CHUNKS,
            versions["chunks"],
            {
                bucket_key(b): ({**chunk_metadata(states[b]), **more}, states[b].chunks_digest)
                for b, more in sorted(extra.items())
            },
            {key: {DOCUMENTS: docs[key], SOURCE_FILES: source} for key in docs},
        )
    )


def build_ingest(code_versions: Mapping[str, str], n: int) -> dg.AssetsDefinition:
    """The multi-asset over ``n`` buckets (a factory: the bucket count and the code versions are
    the settings', which tests change in-process)."""
    v = code_versions
    common: dict[str, Any] = dict(partitions_def=bucket_partitions(n), backfill_policy=dg.BackfillPolicy.single_run())
    spec: dict[str, Any] = dict(group_name=GROUP, kinds={"postgres"})
    with warnings.catch_warnings():  # backfill_policy is "beta" in 1.13; it is the point of this layout
        warnings.filterwarnings("ignore", message=".*backfill_policy.*", category=dg.BetaWarning)

        @dg.multi_asset(
            name=INGEST_OP,
            can_subset=False,
            **common,
            specs=[
                dg.AssetSpec(
                    DOCUMENTS,
                    deps=[SOURCE_FILES],
                    code_version=v["documents"],
                    **spec,
                    description="Source documents extracted to text, by bucket of document ids. "
                    "Materialized together with chunks. Code version: the extractor "
                    "version of every format; per partition: its counts, its "
                    "quarantined ids and a digest of its documents' text.",
                ),
                dg.AssetSpec(
                    CHUNKS,
                    deps=[DOCUMENTS, SOURCE_FILES],
                    code_version=v["chunks"],
                    **spec,
                    description="Current chunks of each bucket's documents in app.chunks, enqueued "
                    "for embedding. Per partition: chunk and token counts, a digest.",
                ),
            ],
        )
        def ingest(
            context: dg.AssetExecutionContext,
            postgres: PostgresResource,
            embedding_provider: EmbeddingProviderResource,
            source: SourceDirectoryResource,
        ) -> Iterator[dg.MaterializeResult]:
            """Bring the buckets current: changed and stale documents only; unchanged files are not read."""
            started = time.monotonic()
            keys = list(context.partition_keys)
            bucket_ids = bucket_indexes(keys)
            rt = embedding_provider.runtime(dagster_run_id=context.run.run_id)
            src = source.source(rt.settings)
            root = src.key
            rerun = RERUN_TAG in context.run.tags
            try:
                # A rerun after a code fix re-extracts the stale documents only; source changes are the source
                # sensor's run (a backfill or a "materialize" from the UI does both, walking the source).
                done = bk.sync_buckets(rt, postgres.pool(), src, bucket_ids, n, source_changes=not rerun)
            except bucket_rows.BucketCountMismatch as exc:
                raise dg.Failure(description=str(exc), allow_retries=False) from None
            context.log.info(
                f"synced {len(keys)} bucket(s) ({'no walk' if rerun else 'walked the source'}): "
                f"{done.changed} changed, {done.stale} stale, {done.gone} gone "
                f"in {time.monotonic() - started:.2f} s"
            )
            with postgres.connection() as conn:
                states = bucket_rows.states_of(conn, root, bucket_ids, n)
            for b, state in states.items():
                context.add_asset_metadata(document_metadata(state), asset_key=DOCUMENTS, partition_key=bucket_key(b))
                context.add_asset_metadata(chunk_metadata(state), asset_key=CHUNKS, partition_key=bucket_key(b))
            run_meta: dict[str, Any] = {
                "partitions": len(keys),
                "source": src.describe(),
                "source_root": root,
                "source_kind": src.kind,
                "files_read": done.scan.hashed,
                "changed_documents": done.changed,
                "stale_documents": done.stale,
                "gone_documents": done.gone,
                "walked_source": not rerun,
            }
            yield dg.MaterializeResult(
                asset_key=DOCUMENTS,
                data_version=dg.DataVersion(run_version({bucket_key(b): s.text_digest for b, s in states.items()})),
                metadata={**_counts(done.report), **run_meta, "duration_seconds": round(time.monotonic() - started, 3)},
            )
            yield dg.MaterializeResult(
                asset_key=CHUNKS,
                data_version=dg.DataVersion(run_version({bucket_key(b): s.chunks_digest for b, s in states.items()})),
                metadata={
                    "partitions": len(keys),
                    "chunks": sum(s.chunks for s in states.values()),
                    "tokens": sum(s.tokens for s in states.values()),
                },
            )

    return ingest


def source_files_spec(n: int) -> dg.AssetSpec:
    """The source's files by bucket, observed by the source sensor (never materialized): a
    bucket observed after its ``documents`` materialization with another data version shows
    that partition STALE until a run brings it current."""
    return dg.AssetSpec(
        SOURCE_FILES,
        partitions_def=bucket_partitions(n),
        group_name=GROUP,
        description="The source's files by bucket. The source_documents sensor records an "
        "observation of each bucket with new, changed or gone files (data version: "
        "a digest of them), so documents shows that bucket stale until its run.",
    )
