"""The rerun sensor: partial reruns of exactly the partitions whose extract or chunk
stage ran under another code version, with the same selection as `pipeline-assets rerun`
(``app.rerun.select``; the extractor version is per format, so a PDF-only fix reruns
PDF documents only).

Run keys. ``rerun@{epoch}.{generation}:{document}:{versions}`` for one document,
``rerun@{epoch}.{generation}@{versions}:{count}:{digest}:{first}..{last}`` for a
range. The cursor holds ``epoch`` and ``generation``; a tick that requests runs
stores ``generation + 1``. So:

* a re-evaluation of the same tick (the daemon died before saving the cursor)
  yields the same keys, and Dagster launches nothing twice;
* a rerun that failed before committing leaves its documents stale, and the
  next tick after it ended (the sensor waits while its runs are in flight)
  requests them again under a new generation, instead of their key being
  skipped as used forever;
* the epoch is derived from the instance's run history when the cursor is
  empty (the first tick, or after a cursor reset in the UI): one more than the
  epoch of this sensor's latest run (tag ``pipeline/rerun_generation``), then
  kept in the cursor. Dagster deduplicates against the run keys of existing
  runs, so after a reset generation 0 of the new epoch collides with none of
  them, and a re-evaluation of that first tick derives the same epoch.
"""

import json

import dagster as dg

from pipeline_assets.app import rerun as rerun_uc
from pipeline_assets.defs import extractor_observations as observe
from pipeline_assets.defs.assets import DOCUMENT_PARTITIONS, FORCE_TAG, PARTITIONS_NAME, RERUN_TAG, valid_partition_keys
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.defs.run_requests import (EMBED_JOB, IN_FLIGHT, MAX_KEYS_PER_TICK, MAX_RUNS_PER_TICK,
                                               TRIGGER_TAG, batch_digest, contiguous_groups, run_request)

RERUN_SCAN_LIMIT = 100_000   # stale documents one tick reads from the database
RERUN_CURSOR_VERSION = 1
GENERATION_TAG = "pipeline/rerun_generation"   # "{epoch}.{generation}" of the tick that requested the run
SENSOR_NAME = "rerun_stale_documents"


def decode_rerun_cursor(raw: str | None) -> tuple[int, int] | None:
    """(epoch, generation), or None for an empty or unreadable cursor."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
        if data.get("v") == RERUN_CURSOR_VERSION:
            return int(data["e"]), int(data["g"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def next_epoch(instance: dg.DagsterInstance) -> int:
    """One more than the epoch of this sensor's latest run (epochs only grow, so it is the largest)."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_NAME}), limit=1)
    tag = runs[0].tags.get(GENERATION_TAG, "") if runs else ""
    try:
        return int(tag.split(".")[0]) + 1
    except ValueError:
        return 1


def encode_rerun_cursor(epoch: int, generation: int) -> str:
    return json.dumps({"v": RERUN_CURSOR_VERSION, "e": epoch, "g": generation}, separators=(",", ":"))


@dg.sensor(name=SENSOR_NAME, job=EMBED_JOB, minimum_interval_seconds=60,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Requests reruns of exactly the partitions whose extract or chunk stage ran under "
                       "another code version (app.rerun.select; the extractor's is per format). A failed "
                       "rerun is requested again on a later tick (a new generation in the run key).")
def rerun_stale_documents_sensor(context: dg.SensorEvaluationContext, postgres: PostgresResource,
                                 embedding_provider: EmbeddingProviderResource,
                                 source: SourceDirectoryResource) -> dg.SensorResult | dg.SkipReason:
    in_flight = context.instance.get_runs_count(
        dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_NAME}, statuses=IN_FLIGHT))
    if in_flight:
        # The targets of a running rerun are still stale in the database; wait for it.
        return dg.SkipReason(f"{in_flight} rerun run(s) still in flight")
    epoch, generation = decode_rerun_cursor(context.cursor) or (next_epoch(context.instance), 0)
    rt = embedding_provider.runtime()
    ext_version, chunk_version = str(rt.options.extractor_version), rt.options.chunker.version
    root = str(source.root_path(rt.settings))
    # The same selection as `pipeline-assets rerun --stale`, for both stages.
    targets = rerun_uc.select(rt, postgres.pool(), stages_=rerun_uc.VERSIONED_STAGES, stale=True,
                              limit=RERUN_SCAN_LIMIT)
    docs = valid_partition_keys(sorted({t.document_id for t in targets if t.root == root}), context.log)
    docs = docs[:MAX_KEYS_PER_TICK]
    if not docs:
        return dg.SkipReason(f"nothing stale under extract={ext_version} chunk={chunk_version}")
    # The UI marks these documents stale now: their format's new extractor version, observed.
    observe.report(context.instance, observe.changed(
        context.instance, {k: rt.options.extractor_version.of(k) for k in docs}))

    existing = context.instance.get_dynamic_partitions(PARTITIONS_NAME)
    existing_set = set(existing)
    to_add = [k for k in docs if k not in existing_set]   # ingested by the CLI, never a partition
    groups = contiguous_groups([*existing, *to_add], set(docs))[:MAX_RUNS_PER_TICK]
    versions = f"{ext_version}:{chunk_version}"
    tags = {TRIGGER_TAG: SENSOR_NAME, FORCE_TAG: "true",
            RERUN_TAG: f"extract={ext_version} chunk={chunk_version}", GENERATION_TAG: f"{epoch}.{generation}"}
    requests = []
    for group in groups:
        if len(group) == 1:
            key = f"rerun@{epoch}.{generation}:{group[0]}:{versions}"
        else:
            digest = batch_digest((k, versions) for k in group)
            key = f"rerun@{epoch}.{generation}@{versions}:{len(group)}:{digest}:{group[0]}..{group[-1]}"
        requests.append(run_request(group, key, tags))
    context.log.info(f"{len(docs)} stale document(s) -> {len(requests)} run(s), generation {epoch}.{generation}")
    return dg.SensorResult(
        run_requests=requests, cursor=encode_rerun_cursor(epoch, generation + 1),
        dynamic_partitions_requests=[DOCUMENT_PARTITIONS.build_add_request(to_add)] if to_add else [])
