"""``source_documents``: new, changed and deleted documents become ONE run over their buckets.

A tick scans the source (observations in PostgreSQL, ``app/observations.py``: an unchanged file
is not read) and requests one ``sync_and_embed`` run over the range spanning the buckets with
pending files, tagged with those buckets (``PENDING_TAG``: the run syncs them without a walk and
embeds them; the first request, every bucket in full, is a ``sync_documents`` run), keyed
``sync@g{n}:{buckets}:{digest}:{first}..{last}`` (the digest covers every pending (document,
checksum), ``n`` the cursor generation the tick started from: a re-evaluated tick repeats its key).
The cursor holds only ``n`` (``{"v": 2, "g": n[, "f": last failed run handled]}``); a legacy map
cursor seeds the table. While a run of this sensor is in flight a tick neither scans nor requests.
Files of a failed or cancelled run are requested again after a backoff (``schedule_retries``).
A source that cannot be scanned fails the tick; an empty one that had documents is a skip.
"""

import json

import dagster as dg

from pipeline_assets.app import observations
from pipeline_assets.content.source import SourceError
from pipeline_assets.defs.dagster_config import DEFAULT_PARTITION_BUCKETS, DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS
from pipeline_assets.defs.embeddings.assets import EMBEDDING_POOL
from pipeline_assets.defs.ingest.jobs import SYNC_JOB
from pipeline_assets.defs.ingest.sync_and_embed import build_sync_and_embed_job
from pipeline_assets.defs.keys import SOURCE_FILES
from pipeline_assets.defs.partitions import bucket_index, bucket_key, span, split_key
from pipeline_assets.defs.provenance import DATA_VERSION_TAG
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.defs.run_requests import (
    IN_FLIGHT,
    PENDING_TAG,
    SYNC_EMBED_JOB_NAME,
    SYNC_JOB_NAME,
    TRIGGER_TAG,
    batch_digest,
    encode_buckets,
    range_request,
    run_span,
)
from pipeline_assets.providers import model_id_for
from pipeline_assets.store import bucket_rows, source_observations

SENSOR_NAME = "source_documents"
CURSOR_VERSION = 2  # {"v": 2, "g": generation[, "f": the last failed run handled]}
LEGACY_CURSOR_VERSION = 1  # {"v": 1, "g": generation, "d": {document: checksum}}: seeds the table once


class SourceScanError(Exception):
    """The source cannot be scanned: the tick fails (the UI shows it) and nothing is deleted."""


# -- cursor -------------------------------------------------------------------


def decode_cursor(raw: str | None) -> tuple[int | None, dict[str, str]]:
    """(generation, legacy {document_id: checksum} map); generation None without a readable cursor."""
    if not raw:
        return None, {}
    try:
        data = json.loads(raw)
        if data.get("v") == CURSOR_VERSION:
            return int(data["g"]), {}
        if data.get("v") == LEGACY_CURSOR_VERSION:
            return int(data["g"]), dict(data["d"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return None, {}


def encode_cursor(generation: int, handled_failure: str | None = None) -> str:
    data: dict[str, object] = {"v": CURSOR_VERSION, "g": generation}
    if handled_failure:
        data["f"] = handled_failure
    return json.dumps(data, separators=(",", ":"))


def decode_handled_failure(raw: str | None) -> str | None:
    """The id of the last failed or cancelled run of this sensor a tick has handled, if any."""
    try:
        value = json.loads(raw).get("f") if raw else None
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _unhandled_failure(instance: dg.DagsterInstance, handled: str | None) -> dg.DagsterRun | None:
    """This sensor's latest run, if it failed or was cancelled and no tick has handled it yet."""
    records = instance.get_run_records(dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_NAME}), limit=1)
    if not records:
        return None
    run = records[0].dagster_run
    ended_badly = run.status in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
    return run if ended_badly and run.run_id != handled else None


def _run_buckets(run: dg.DagsterRun) -> tuple[int, int] | None:
    """The first and last bucket a run covered: a bucket run's (``b003``) or the embeddings run
    after it (``b003|model``); None: a run without partition tags."""
    span = run_span(run)
    try:
        return (_bucket_of(span[0]), _bucket_of(span[1])) if span else None
    except ValueError:
        return None


def _bucket_of(key: str) -> int:
    return split_key(key)[0] if "|" in key else bucket_index(key)


# -- source changes -------------------------------------------------------------------
def _scan_source(
    context: dg.SensorEvaluationContext,
    postgres: PostgresResource,
    embedding_provider: EmbeddingProviderResource,
    source: SourceDirectoryResource,
) -> dg.SensorResult:
    settings = embedding_provider.settings()
    try:
        src = source.source(settings)
        src.check()
    except SourceError as exc:
        raise SourceScanError(f"{exc}; nothing is deleted on that account") from None
    root = src.key
    generation, legacy = decode_cursor(context.cursor)
    handled = decode_handled_failure(context.cursor)
    in_flight = context.instance.get_runs_count(dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_NAME}, statuses=IN_FLIGHT))
    if in_flight and generation is not None and not legacy:
        # Backpressure, before the scan: a walk of a large source costs seconds of the
        # machine the run is using, and what changed is found by the next free tick's scan.
        return dg.SensorResult(
            cursor=encode_cursor(generation, handled),
            skip_reason=(
                f"{in_flight} run(s) of this sensor still queued or running; the source is scanned "
                "again on the next tick after they end"
            ),
        )
    with postgres.connection() as conn:
        n = bucket_rows.check_buckets(conn, settings.partition_buckets)
        if legacy and generation is not None:
            source_observations.adopt(conn, root, legacy, generation - 1)
        try:
            found = observations.scan(conn, src, max_bytes=settings.max_input_bytes)
        except SourceError as exc:
            raise SourceScanError(f"cannot scan {src.describe()}: {exc}; nothing is deleted on that account") from None
        context.log.info(
            f"{found.present} file(s): {found.hashed} read, {found.unread} new (read by the run), "
            f"{found.written} observation(s) written, "
            f"{found.gone} gone, {found.unreadable} unreadable"
        )
        if generation is None:
            generation = source_observations.latest_generation(conn, root) or 0
        failed = None if in_flight else _unhandled_failure(context.instance, handled)
        if failed is not None:
            # Its files are requested again after the backoff: those it did not sync (below), and
            # those it synced but did not embed (its embeddings step failed or was cancelled).
            span_of = _run_buckets(failed)
            if span_of is not None:
                unembedded = source_observations.unsync_unembedded(
                    conn, root, span_of[0], span_of[1], n, model_id_for(settings.provider_config())
                )
                context.log.info(
                    f"run {failed.run_id} ended {failed.status.value}: {unembedded} file(s) it "
                    "synced but did not embed are requested again after the backoff"
                )
            handled = failed.run_id
        # Unchanged (a legacy map cursor shrinks to its generation).
        cursor = encode_cursor(generation, handled)
        if found.empty_refused:
            return dg.SensorResult(
                cursor=cursor,
                skip_reason=(
                    f"source {src.describe()} is empty but {found.empty_refused} documents were seen before; "
                    "refusing to delete them all"
                ),
            )
        # None of the sensor's runs in flight: the requests of earlier generations have ended.
        retry_base = settings.dagster_config().source_retry_base
        retries = (
            None if in_flight else source_observations.schedule_retries(conn, root, generation, retry_base=retry_base)
        )
        todo = source_observations.pending_buckets(conn, root, generation, n)
        if not todo:
            waiting = (
                f"; {retries.waiting} file(s) of failed or cancelled runs requested again in {retries.next_in:.0f} s"
                if retries and retries.waiting
                else ""
            )
            return dg.SensorResult(
                cursor=cursor,
                skip_reason=(f"no change among {found.present} documents ({found.hashed} file(s) read){waiting}"),
            )
        files = sum(p.documents for p in todo)
        if in_flight:  # a cursor that was empty or legacy: the tick above seeded the table first
            # Backpressure: nothing is marked requested, so the next free tick asks for all of it.
            return dg.SensorResult(
                cursor=cursor,
                skip_reason=(
                    f"{in_flight} run(s) of this sensor still queued or running; {files} change(s) in "
                    f"{len(todo)} bucket(s) wait for the next tick"
                ),
            )
        # The first request covers every bucket, so the empty ones are materialized (empty) too and
        # the UI shows the corpus complete instead of "missing" buckets no file hashes to.
        first, last = span([0, n - 1] if generation == 0 else [p.bucket for p in todo])
        digest = batch_digest((str(p.bucket), p.digest) for p in todo)
        key = f"sync@g{generation}:{len(todo)}:{digest}:{first}..{last}"
        source_observations.mark_buckets_requested(conn, root, [p.bucket for p in todo], n, generation)
    new, gone = sum(p.new for p in todo), sum(p.gone for p in todo)
    context.log.info(
        f"new={new} changed={files - new - gone} gone={gone} in {len(todo)} bucket(s): one run over {first}..{last}"
    )
    tags = {TRIGGER_TAG: SENSOR_NAME}
    job_name = SYNC_JOB_NAME
    if generation:  # the first request syncs every bucket in full (what no scan has observed yet too)
        tags[PENDING_TAG] = encode_buckets(p.bucket for p in todo)
        job_name = SYNC_EMBED_JOB_NAME  # one run syncs and embeds them: one launch, no sensor between
    request = range_request(first, last, key, tags, job_name=job_name)
    # What the sensor saw, per bucket with pending files: documents shows those buckets stale
    # (a new data version of source_files) until the run's materialization records it.
    seen = [
        dg.AssetObservation(
            SOURCE_FILES,
            partition=bucket_key(p.bucket),
            metadata={"pending_files": p.documents},
            tags={DATA_VERSION_TAG: f"g{generation}:{p.digest}"},
        )
        for p in todo
    ]
    return dg.SensorResult(run_requests=[request], asset_events=seen, cursor=encode_cursor(generation + 1, handled))


def build_source_sensor(
    interval_seconds: int = DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS,
    sync_and_embed: dg.JobDefinition | None = None,
) -> dg.SensorDefinition:
    """The source sensor, ticking every ``interval_seconds`` (``Settings.source_sensor_interval``),
    requesting ``sync_documents`` and ``sync_and_embed`` (default: over the default bucket count,
    embedding in the ``embedding_worker`` pool)."""
    job = sync_and_embed or build_sync_and_embed_job(DEFAULT_PARTITION_BUCKETS, EMBEDDING_POOL)
    return dg.sensor(
        name=SENSOR_NAME,
        jobs=[SYNC_JOB, job],
        minimum_interval_seconds=interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Scans the source directory (observations kept in PostgreSQL; unchanged files are not "
        "read) and requests one run that syncs and embeds the buckets of new, changed and vanished "
        "documents; nothing while its earlier runs are in flight.",
    )(_scan_source)


source_documents_sensor = build_source_sensor()
