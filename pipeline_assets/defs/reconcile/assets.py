"""``reconciliation``: the core's ``reconcile_all`` as an asset, and what it changed told to Dagster.

It re-scans every ingested source and repairs the job table set-based (config ``rescan:
false``: the job table only). Each bucket of the watched source holding a document it
ingested, re-ingested or tombstoned gets a ``documents`` and a ``chunks`` materialization
with the bucket's counts, the ids it changed and the versions an asset run records
(``provenance``); ``embeddings`` gets nothing (its jobs are only enqueued). A re-ingested
file is retried at once by the source sensor (``source_observations.retry_now``). Its own counts
are numeric metadata of the ``reconciliation`` materialization, plotted run over run.
"""

import time
from collections.abc import Iterator

import dagster as dg

from pipeline_assets.app import buckets as bk
from pipeline_assets.app.reconcile import reconcile_all
from pipeline_assets.app.runtime import code_versions
from pipeline_assets.defs.ingest.assets import ingest_materializations
from pipeline_assets.defs.keys import GROUP
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.store import bucket_rows, source_observations, stage_runs
from pipeline_assets.store.documents import touched_since


class ReconcileConfig(dg.Config):
    rescan: bool = True  # false: repair the job table only; no source file is read


@dg.asset(
    name="reconciliation",
    group_name=GROUP,
    kinds={"postgres"},
    description="Re-scan every ingested source and repair the job table (core reconcile(); "
    "config rescan: false repairs the job table only). Buckets of the watched source in "
    "which it added, changed or tombstoned documents get documents/chunks "
    "materializations. Its counts are numeric metadata.",
)
def reconciliation(
    context: dg.AssetExecutionContext,
    config: ReconcileConfig,
    postgres: PostgresResource,
    embedding_provider: EmbeddingProviderResource,
    source: SourceDirectoryResource,
) -> Iterator[dg.MaterializeResult | dg.AssetMaterialization]:
    started = time.monotonic()
    rt = embedding_provider.runtime(dagster_run_id=context.run.run_id)
    root = source.source(rt.settings).key
    n = postgres.bucket_count(rt.settings.partition_buckets)
    with postgres.connection() as conn:
        since = stage_runs.clock(conn)
    report = reconcile_all(rt, postgres.pool(), rescan=config.rescan)
    with postgres.connection() as conn:
        touched = bk.buckets_of([t.document_id for t in touched_since(conn, root, since)], n)
        source_observations.retry_now(conn, root, [d for docs in touched.values() for d in docs])
        states = bucket_rows.states_of(conn, root, list(touched), n)
    for problem in report.missing_sources:
        context.log.warning(problem)
    yield from ingest_materializations(
        context.instance,
        states,
        {
            b: {
                "reported_by": "reconciliation",
                "changed_documents": ", ".join(docs[: bucket_rows.SAMPLE_IDS]),
                "changed_count": len(docs),
            }
            for b, docs in touched.items()
        },
        code_versions(rt.settings),
    )
    counts = {k: int(v) for k, v in report.as_dict().items() if isinstance(v, int)}
    metadata: dict = {
        **counts,
        "missing_sources": len(report.missing_sources),
        "buckets_reported": len(touched),
        "documents_reported": sum(len(d) for d in touched.values()),
        "source_root": root,
        "duration_seconds": round(time.monotonic() - started, 3),
    }
    if report.missing_sources:
        metadata["missing_source_errors"] = "\n".join(report.missing_sources)
    yield dg.MaterializeResult(metadata=metadata)
