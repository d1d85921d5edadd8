"""``rerun_stale_documents``: partial reruns after a code-version bump.

The documents whose extract or chunk stage ran under another code version (``app.rerun.select``,
as `pipeline-assets rerun --stale`; the extractor version is per format) are brought current by
ONE ``sync_documents`` run over every bucket (tag ``pipeline/rerun``: stale documents only, no
source scan). After a check that found nothing stale, ticks under the same versions read
nothing for RERUN_RECHECK_SECONDS. Run key ``rerun@{epoch}.{generation}@{versions}:{count}:{digest}``:
a re-evaluated tick repeats it; a requested run advances the generation, so a failed rerun is
requested again under a new key, after a backoff (``retry_wait``: RERUN_RETRY_BASE_SECONDS
doubling per failure in a row under the same versions, at most RERUN_RETRY_CAP_SECONDS). An
empty cursor derives its epoch from the run history (one more than the latest run's), so
after a reset no new key collides with an old run's.
"""

import json
import time
from dataclasses import dataclass

import dagster as dg

from pipeline_assets.app import rerun as rerun_uc
from pipeline_assets.defs.ingest.jobs import SYNC_JOB
from pipeline_assets.defs.partitions import bucket_key
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.defs.run_requests import (
    GENERATION_TAG,
    IN_FLIGHT,
    RERUN_TAG,
    TRIGGER_TAG,
    batch_digest,
    range_request,
)

RERUN_SCAN_LIMIT = 100_000  # stale targets of the source one tick reads (the run redoes every one)
RERUN_CURSOR_VERSION = 1
# Seconds between ticks: how long a restart with a code fix waits for its rerun, at most.
RERUN_INTERVAL_SECONDS = 10
# How long a check that found nothing stale stands while the code versions stay the same:
# the ticks in between read nothing from the database.
RERUN_RECHECK_SECONDS = 300
SENSOR_NAME = "rerun_stale_documents"
# A rerun that failed (or was cancelled) is requested again RERUN_RETRY_BASE_SECONDS after it
# ended, twice as long after each further failure in a row under the same code versions, at
# most RERUN_RETRY_CAP_SECONDS; a version change (a fix) is requested at the next tick.
RERUN_RETRY_BASE_SECONDS = 60.0
RERUN_RETRY_CAP_SECONDS = 3600.0
# The latest runs read to count the failures in a row (the cap is reached well before).
RERUN_FAILURES_READ = 16
_ENDED_BADLY = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


@dataclass(frozen=True)
class RerunCursor:
    """The rerun sensor's cursor: its epoch and generation, and its last clean check, if any
    (the code versions it ran under, and when: ``time.time()``)."""

    epoch: int
    generation: int
    clean_versions: str | None = None
    clean_at: float = 0.0

    def clean_under(self, versions: str, now: float) -> bool:
        """A check under these versions found nothing stale less than RERUN_RECHECK_SECONDS ago."""
        return self.clean_versions == versions and 0 <= now - self.clean_at < RERUN_RECHECK_SECONDS


def decode_rerun_cursor(raw: str | None) -> RerunCursor | None:
    """The cursor, or None for an empty or unreadable one."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
        if data.get("v") == RERUN_CURSOR_VERSION:
            clean = data.get("c")
            return RerunCursor(
                int(data["e"]), int(data["g"]), str(clean[0]) if clean else None, float(clean[1]) if clean else 0.0
            )
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
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


def encode_rerun_cursor(epoch: int, generation: int, clean: tuple[str, float] | None = None) -> str:
    data: dict[str, object] = {"v": RERUN_CURSOR_VERSION, "e": epoch, "g": generation}
    if clean is not None:
        data["c"] = [clean[0], round(clean[1], 3)]
    return json.dumps(data, separators=(",", ":"))


def retry_wait(instance: dg.DagsterInstance, rerun_tag: str, now: float) -> tuple[int, float]:
    """(failures in a row, seconds still to wait) for this sensor's reruns under ``rerun_tag`` (the
    code versions): the latest runs that failed or were cancelled, newest first, until one that
    did not; the wait runs from the end of the latest."""
    records = instance.get_run_records(dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_NAME}), limit=RERUN_FAILURES_READ)
    failures, ended_at = 0, None
    for record in records:
        run = record.dagster_run
        if run.status not in _ENDED_BADLY or run.tags.get(RERUN_TAG) != rerun_tag:
            break
        failures += 1
        if ended_at is None:
            ended_at = record.end_time or record.update_timestamp.timestamp()
    if not failures or ended_at is None:
        return 0, 0.0
    backoff = min(RERUN_RETRY_CAP_SECONDS, RERUN_RETRY_BASE_SECONDS * 2 ** (failures - 1))
    return failures, max(0.0, ended_at + backoff - now)


@dg.sensor(
    name=SENSOR_NAME,
    job=SYNC_JOB,
    minimum_interval_seconds=RERUN_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="After an extractor or chunker version bump: one run over every bucket that "
    "re-extracts exactly the documents whose stage ran under another code version "
    "(app.rerun.select; the extractor's is per format). A failed rerun is requested again "
    "after a backoff (60 s doubling per failure in a row, at most an hour).",
)
def rerun_stale_documents_sensor(
    context: dg.SensorEvaluationContext,
    postgres: PostgresResource,
    embedding_provider: EmbeddingProviderResource,
    source: SourceDirectoryResource,
) -> dg.SensorResult | dg.SkipReason:
    in_flight = context.instance.get_runs_count(dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_NAME}, statuses=IN_FLIGHT))
    if in_flight:
        # The targets of a running rerun are still stale in the database; wait for it.
        return dg.SkipReason(f"{in_flight} rerun run(s) still in flight")
    state = decode_rerun_cursor(context.cursor) or RerunCursor(next_epoch(context.instance), 0)
    rt = embedding_provider.runtime()
    ext_version, chunk_version = str(rt.options.extractor_version), rt.options.chunker.version
    versions = f"{ext_version}:{chunk_version}"
    now = time.time()
    if state.clean_under(versions, now):
        return dg.SkipReason(
            f"nothing stale under extract={ext_version} chunk={chunk_version} (checked "
            f"{now - state.clean_at:.0f} s ago; checked again after {RERUN_RECHECK_SECONDS} s "
            "or when a code version changes)"
        )
    rerun_tag = f"extract={ext_version} chunk={chunk_version}"
    failures, wait = retry_wait(context.instance, rerun_tag, now)
    if wait > 0:
        return dg.SkipReason(
            f"the rerun under {rerun_tag} failed {failures} time(s) in a row; requested again "
            f"in {wait:.0f} s (backoff {RERUN_RETRY_BASE_SECONDS:.0f} s doubling per failure, "
            f"at most {RERUN_RETRY_CAP_SECONDS:.0f} s)"
        )
    root = source.source(rt.settings).key
    # The same selection as `pipeline-assets rerun --stale`, for both stages.
    targets = rerun_uc.select(
        rt, postgres.pool(), stages_=rerun_uc.VERSIONED_STAGES, stale=True, root=root, limit=RERUN_SCAN_LIMIT
    )
    docs = sorted({t.document_id for t in targets})
    epoch, generation = state.epoch, state.generation
    if not docs:
        return dg.SensorResult(
            cursor=encode_rerun_cursor(epoch, generation, (versions, now)),
            skip_reason=f"nothing stale under extract={ext_version} chunk={chunk_version}",
        )
    key = f"rerun@{epoch}.{generation}@{versions}:{len(docs)}:{batch_digest((d, versions) for d in docs)}"
    tags = {TRIGGER_TAG: SENSOR_NAME, RERUN_TAG: rerun_tag, GENERATION_TAG: f"{epoch}.{generation}"}
    last = bucket_key(rt.settings.partition_buckets - 1)
    context.log.info(f"{len(docs)} stale document(s) -> one run over every bucket, generation {epoch}.{generation}")
    return dg.SensorResult(
        run_requests=[range_request(bucket_key(0), last, key, tags)], cursor=encode_rerun_cursor(epoch, generation + 1)
    )
