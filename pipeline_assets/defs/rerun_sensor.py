"""The rerun sensor: partial reruns of exactly the partitions whose extract or chunk
stage ran under another code version, with the same selection as `pipeline-assets rerun`."""

import dagster as dg

from pipeline_assets.app import rerun as rerun_uc
from pipeline_assets.defs.assets import DOCUMENT_PARTITIONS, FORCE_TAG, PARTITIONS_NAME, RERUN_TAG, valid_partition_keys
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.defs.run_requests import (EMBED_JOB, IN_FLIGHT, MAX_KEYS_PER_TICK, MAX_RUNS_PER_TICK,
                                               TRIGGER_TAG, batch_digest, contiguous_groups, run_request)

RERUN_SCAN_LIMIT = 100_000   # stale documents one tick reads from the database


# -- (b) partial reruns after a parser/chunker fix -----------------------------------
@dg.sensor(name="rerun_stale_documents", job=EMBED_JOB, minimum_interval_seconds=60,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Requests reruns of exactly the partitions whose extract or chunk stage ran under "
                       "another code version (app.rerun.select); once per version.")
def rerun_stale_documents_sensor(context: dg.SensorEvaluationContext, postgres: PostgresResource,
                                 embedding_provider: EmbeddingProviderResource,
                                 source: SourceDirectoryResource) -> dg.SensorResult | dg.SkipReason:
    in_flight = context.instance.get_runs_count(
        dg.RunsFilter(tags={TRIGGER_TAG: "rerun_stale_documents"}, statuses=IN_FLIGHT))
    if in_flight:
        # The targets of a running rerun are still stale in the database; wait for it.
        return dg.SkipReason(f"{in_flight} rerun run(s) still in flight")
    rt = embedding_provider.runtime()
    ext_version, chunk_version = rt.options.extractor_version, rt.options.chunker.version
    root = str(source.root_path(rt.settings))
    # The same selection as `pipeline-assets rerun --stale`, for both stages.
    targets = rerun_uc.select(rt, postgres.pool(), stages_=rerun_uc.RERUN_STAGES, stale=True,
                              limit=RERUN_SCAN_LIMIT)
    docs = valid_partition_keys(sorted({t.document_id for t in targets if t.root == root}), context.log)
    docs = docs[:MAX_KEYS_PER_TICK]
    if not docs:
        return dg.SkipReason(f"nothing stale under extract={ext_version} chunk={chunk_version}")

    existing = context.instance.get_dynamic_partitions(PARTITIONS_NAME)
    existing_set = set(existing)
    to_add = [k for k in docs if k not in existing_set]   # ingested by the CLI, never a partition
    groups = contiguous_groups([*existing, *to_add], set(docs))[:MAX_RUNS_PER_TICK]
    versions = f"{ext_version}:{chunk_version}"
    tags = {TRIGGER_TAG: "rerun_stale_documents", FORCE_TAG: "true",
            RERUN_TAG: f"extract={ext_version} chunk={chunk_version}"}
    requests = []
    for group in groups:
        if len(group) == 1:
            key = f"rerun:{group[0]}:{versions}"
        else:
            digest = batch_digest((k, versions) for k in group)
            key = f"rerun@{versions}:{len(group)}:{digest}:{group[0]}..{group[-1]}"
        requests.append(run_request(group, key, tags))
    context.log.info(f"{len(docs)} stale document(s) -> {len(requests)} run(s)")
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[DOCUMENT_PARTITIONS.build_add_request(to_add)] if to_add else [])
