"""The source sensor: new, changed and deleted documents become ONE run over their buckets
(the rerun sensor, after a code-version bump, is in rerun_sensor.py).

A tick scans the source (observations in PostgreSQL, ``app/observations.py``:
an unchanged file is not read), groups what is pending by document bucket and
requests one run of ``sync_documents`` over the partition range that spans
those buckets (``BackfillPolicy.single_run``: the assets see every bucket of
the range in ``context.partition_keys``). The run brings each bucket current
(``app.buckets.sync_buckets``): changed files ingested, gone ones tombstoned,
unchanged ones skipped, so a bucket inside the range with nothing pending
costs a scan of nothing. The partition count never grows: 10 or 1M documents,
one run per tick at most.

Run keys: ``sync@g{n}:{buckets}:{digest}:{first}..{last}``; the digest covers
every pending (document, checksum) pair. ``n`` is the cursor generation the tick
started from, so a re-evaluation of the same tick (daemon crash before the
cursor was saved, a duplicate observation) yields the same key and Dagster
launches nothing, while a later revert of a file to earlier bytes (A -> B -> A)
is a new observation and does run.

State. The cursor holds only the generation (``{"v": 2, "g": n}``); what the
sensor saw lives in PostgreSQL (``app.source_observations``): per file its
checksum, size and mtime (the prefilter), the checksum last requested with the
generation that asked, and the checksum a bucket run last synced. A tick marks
the pending files of the buckets it requested as requested under ``n``; if
Dagster does not save the cursor ``n + 1``, the next evaluation starts from
``n`` again, finds the same rows pending (requested at ``>= n``) and asks for
the same run key. A cleared cursor goes on from the latest generation in the
table. A legacy cursor holding the whole map seeds the table.

Backpressure. While a run this sensor requested is queued or running, a tick
requests nothing and does not scan (a walk of 100k files is seconds of the
machine the run is using); the next free tick scans and requests what changed.

Deletions. A vanished file is pending until the bucket run tombstones its
document and forgets its row. A source that cannot be scanned (missing or
unreadable directory) is a failed tick, shown in the UI, and deletes nothing;
an empty source that had documents is a skip that deletes nothing.
"""

import json

import dagster as dg

from pipeline_assets.app import buckets as bk
from pipeline_assets.app import observations
from pipeline_assets.content.sources import SourceError
from pipeline_assets.defs.partitions import span
from pipeline_assets.defs.rerun_sensor import rerun_stale_documents_sensor
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.defs.run_requests import IN_FLIGHT, SYNC_JOB, TRIGGER_TAG, batch_digest, range_request
from pipeline_assets.settings import DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS, Settings

__all__ = ["SYNC_JOB", "SourceScanError", "build_sensors", "build_source_sensor", "decode_cursor", "encode_cursor",
           "source_documents_sensor"]

SENSOR_NAME = "source_documents"
CURSOR_VERSION = 2          # {"v": 2, "g": generation}
LEGACY_CURSOR_VERSION = 1   # {"v": 1, "g": generation, "d": {document: checksum}}: seeds the table once


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


def encode_cursor(generation: int) -> str:
    return json.dumps({"v": CURSOR_VERSION, "g": generation}, separators=(",", ":"))


# -- source changes -------------------------------------------------------------------
def _scan_source(context: dg.SensorEvaluationContext, postgres: PostgresResource,
                 embedding_provider: EmbeddingProviderResource,
                 source: SourceDirectoryResource) -> dg.SensorResult:
    settings = embedding_provider.settings()
    root = source.root_path(settings)
    if not root.is_dir():
        raise SourceScanError(f"source directory {root} not found; nothing is deleted on that account")
    generation, legacy = decode_cursor(context.cursor)
    in_flight = context.instance.get_runs_count(
        dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_NAME}, statuses=IN_FLIGHT))
    if in_flight and generation is not None and not legacy:
        # Backpressure, before the scan: a walk of a large source costs seconds of the
        # machine the run is using, and what changed is found by the next free tick's scan.
        return dg.SensorResult(cursor=encode_cursor(generation), skip_reason=(
            f"{in_flight} run(s) of this sensor still queued or running; the source is scanned "
            "again on the next tick after they end"))
    with postgres.connection() as conn:
        n = bk.check_buckets(conn, settings.partition_buckets)
        if legacy and generation is not None:
            observations.adopt(conn, root, legacy, generation - 1)
        try:
            found = observations.scan(conn, root, max_bytes=settings.max_input_bytes)
        except SourceError as exc:
            raise SourceScanError(f"cannot scan {root}: {exc}; nothing is deleted on that account") from exc
        context.log.info(f"{found.present} file(s): {found.hashed} read, {found.unread} new (read by the run), "
                         f"{found.written} observation(s) written, "
                         f"{found.gone} gone, {found.unreadable} unreadable")
        if generation is None:
            generation = observations.latest_generation(conn, root) or 0
        cursor = encode_cursor(generation)   # unchanged (a legacy map cursor shrinks to its generation)
        if found.empty_refused:
            return dg.SensorResult(cursor=cursor, skip_reason=(
                f"source {root} is empty but {found.empty_refused} documents were seen before; "
                "refusing to delete them all"))
        todo = observations.pending_buckets(conn, root, generation, n)
        if not todo:
            return dg.SensorResult(cursor=cursor, skip_reason=(
                f"no change among {found.present} documents ({found.hashed} file(s) read)"))
        files = sum(p.documents for p in todo)
        if in_flight:   # a cursor that was empty or legacy: the tick above seeded the table first
            # Backpressure: nothing is marked requested, so the next free tick asks for all of it.
            return dg.SensorResult(cursor=cursor, skip_reason=(
                f"{in_flight} run(s) of this sensor still queued or running; {files} change(s) in "
                f"{len(todo)} bucket(s) wait for the next tick"))
        # The first request covers every bucket, so the empty ones are materialized (empty) too and
        # the UI shows the corpus complete instead of "missing" buckets no file hashes to.
        first, last = span([0, n - 1] if generation == 0 else [p.bucket for p in todo])
        digest = batch_digest((str(p.bucket), p.digest) for p in todo)
        key = f"sync@g{generation}:{len(todo)}:{digest}:{first}..{last}"
        observations.mark_buckets_requested(conn, root, [p.bucket for p in todo], n, generation)
    new, gone = sum(p.new for p in todo), sum(p.gone for p in todo)
    context.log.info(f"new={new} changed={files - new - gone} gone={gone} in {len(todo)} bucket(s): "
                     f"one run over {first}..{last}")
    request = range_request(first, last, key, {TRIGGER_TAG: SENSOR_NAME})
    return dg.SensorResult(run_requests=[request], cursor=encode_cursor(generation + 1))


def build_source_sensor(interval_seconds: int = DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS) -> dg.SensorDefinition:
    """The source sensor, ticking every ``interval_seconds`` (``Settings.source_sensor_interval``)."""
    return dg.sensor(
        name=SENSOR_NAME, jobs=[SYNC_JOB], minimum_interval_seconds=interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Scans the source directory (observations kept in PostgreSQL; unchanged files are not "
                    "read) and requests one run over the buckets of new, changed and vanished documents; "
                    "nothing while its earlier runs are in flight.")(_scan_source)


source_documents_sensor = build_source_sensor()


def build_sensors(settings: Settings) -> list[dg.SensorDefinition]:
    """The source sensor at the configured interval, and the rerun sensor."""
    return [build_source_sensor(settings.source_sensor_interval), rerun_stale_documents_sensor]
