"""The source sensor: new, changed and deleted documents become partitions and runs
(the rerun sensor, after a code-version bump, is in rerun_sensor.py).

How runs are batched (Dagster 1.13). A RunRequest carries one ``partition_key``
(one run per partition), and a sensor-made backfill (``asset_graph_subset``) has
no ``run_key`` at all, so neither gives both batching and deduplication. What
does: a run over a *partition range*, the same thing a single-run backfill
launches (tags ``dagster/asset_partition_range_start``/``_end``). With
``BackfillPolicy.single_run()`` the assets see every key of the range in
``context.partition_keys``. Dynamic partitions keep insertion order, so the
partitions a tick adds (sorted) are contiguous, and many new documents become
ONE run. Changed documents sit among unchanged ones; they are grouped into
maximal contiguous ranges of wanted keys only, so a run never touches a
partition that was not asked for (the rerun sensor relies on that: exactly the
affected partitions). Bounds per tick: at most MAX_KEYS_PER_TICK keys
(added + deleted + requested) and MAX_RUNS_PER_TICK runs; what is left over
stays pending in the observation table and is picked up by the next tick.

Run keys. A one-document run has ``run_key = f"{document_id}:{checksum}@g{n}"``
and a batch ``"batch@g{n}:{count}:{digest}:{first}..{last}"`` (the digest covers
every document:checksum pair). ``n`` is the cursor generation the tick started
from, so a re-evaluation of the same tick (daemon crash before the cursor was
saved, a duplicate observation) yields the same keys and Dagster launches
nothing, while a later revert of a file to earlier bytes (A -> B -> A) is a new
observation and does run: a bare ``document:checksum`` key would be refused as
a duplicate there and leave B's vectors served until the next reconcile.

State. The cursor holds only the generation (``{"v": 2, "g": n}``, a few bytes
at any corpus size); what the sensor saw lives in PostgreSQL
(``app.source_observations``, ``app/observations.py``): per file its checksum,
size and mtime (the prefilter: an unchanged tick reads no file, also after a
code reload) and the checksum last requested with the generation that asked.
A tick requests what is pending there and marks it requested under its
generation ``n``; if Dagster does not save the cursor ``n + 1``, the next
evaluation starts from ``n`` again, finds the same rows pending (requested at
``>= n``) and asks for the same run keys. A cleared cursor goes on from the
latest generation in the table (only that tick's requests are asked again,
under their old keys). A legacy cursor holding the whole map seeds the table.

Backpressure. While a run this sensor requested is queued or running, a tick
requests nothing (partitions for new documents are still added); what it
observed stays pending and the next free tick requests it.

Deletions. A vanished file is tombstoned in a run of ``tombstone_documents``
(defs/tombstone.py), never inside the evaluation; that run also deletes the
partitions. A source that cannot be scanned (missing or unreadable directory)
is a failed tick, shown in the UI, and deletes nothing; an empty source that
had documents is a skip that deletes nothing.
"""

import json

import dagster as dg

from pipeline_assets.app import observations
from pipeline_assets.content.sources import SourceError
from pipeline_assets.defs.assets import DOCUMENT_PARTITIONS, PARTITIONS_NAME, partition_key_problem
from pipeline_assets.defs.rerun_sensor import rerun_stale_documents_sensor
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.defs.run_requests import (EMBED_JOB, EMBED_JOB_NAME, IN_FLIGHT, MAX_KEYS_PER_TICK,
                                               MAX_RUNS_PER_TICK, TRIGGER_TAG, batch_digest, contiguous_groups,
                                               run_request)
from pipeline_assets.defs.tombstone import tombstone_job, tombstone_request

__all__ = ["EMBED_JOB", "MAX_KEYS_PER_TICK", "SENSORS", "SourceScanError", "contiguous_groups", "decode_cursor",
           "encode_cursor", "source_documents_sensor"]

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


# -- (a) source changes ------------------------------------------------------------
@dg.sensor(name=SENSOR_NAME, jobs=[EMBED_JOB, tombstone_job], minimum_interval_seconds=30,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Scans the source directory (observations kept in PostgreSQL; unchanged files are not "
                       "read); adds partitions for new documents, requests batched runs for new and changed "
                       "ones and a tombstone run for vanished ones; nothing while its earlier runs are in flight.")
def source_documents_sensor(context: dg.SensorEvaluationContext, postgres: PostgresResource,
                            embedding_provider: EmbeddingProviderResource,
                            source: SourceDirectoryResource) -> dg.SensorResult:
    settings = embedding_provider.settings()
    root = source.root_path(settings)
    if not root.is_dir():
        raise SourceScanError(f"source directory {root} not found; nothing is deleted on that account")
    generation, legacy = decode_cursor(context.cursor)
    with postgres.connection() as conn:
        if legacy and generation is not None:
            observations.adopt(conn, root, legacy, generation - 1)
        try:
            found = observations.scan(conn, root, max_bytes=settings.max_input_bytes, refuse=partition_key_problem)
        except SourceError as exc:
            raise SourceScanError(f"cannot scan {root}: {exc}; nothing is deleted on that account") from exc
        if found.refused:
            context.log.warning(f"skipping {len(found.refused)} document(s) whose ids cannot be partition keys "
                                f"(they contain '|', '...' or control characters): {found.refused[:5]}")
        context.log.info(f"{found.present} file(s): {found.hashed} read, {found.written} observation(s) written, "
                         f"{found.gone} gone, {found.unreadable} unreadable")
        if generation is None:
            generation = observations.latest_generation(conn, root) or 0
        cursor = encode_cursor(generation)   # unchanged (a legacy map cursor shrinks to its generation)
        if found.empty_refused:
            return dg.SensorResult(cursor=cursor, skip_reason=(
                f"source {root} is empty but {found.empty_refused} documents were seen before; "
                "refusing to delete them all"))
        todo = observations.pending(conn, root, generation, MAX_KEYS_PER_TICK)
        if not todo:
            return dg.SensorResult(cursor=cursor, skip_reason=(
                f"no change among {found.present} documents ({found.hashed} file(s) read)"))

        existing = context.instance.get_dynamic_partitions(PARTITIONS_NAME)
        existing_set = set(existing)
        gone = [p.document_id for p in todo if p.checksum is None]
        wanted = {p.document_id: p.checksum for p in todo if p.checksum is not None}
        to_add = sorted(k for k in wanted if k not in existing_set)
        add = [DOCUMENT_PARTITIONS.build_add_request(to_add)] if to_add else []
        in_flight = context.instance.get_runs_count(
            dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_NAME}, statuses=IN_FLIGHT))
        if in_flight:
            # Backpressure: nothing is marked requested, so the next free tick asks for all of it.
            return dg.SensorResult(
                skip_reason=f"{in_flight} run(s) of this sensor still queued or running; {len(todo)} change(s) "
                            f"wait for the next tick ({len(to_add)} new partition(s) added)",
                dynamic_partitions_requests=add, cursor=cursor)

        tags = {TRIGGER_TAG: SENSOR_NAME}
        requests: list[dg.RunRequest] = []
        done: list[tuple[str, str | None]] = []
        if gone:
            digest = batch_digest((k, "") for k in gone)
            key = f"tombstone@g{generation}:{len(gone)}:{digest}:{gone[0]}..{gone[-1]}"
            requests.append(tombstone_request(root, gone, key, tags))
            done += [(k, None) for k in gone]
        groups = contiguous_groups([*existing, *to_add], set(wanted))[:MAX_RUNS_PER_TICK]
        for group in groups:
            if len(group) == 1:
                key = f"{group[0]}:{wanted[group[0]]}@g{generation}"
            else:
                digest = batch_digest((k, wanted[k]) for k in group)
                key = f"batch@g{generation}:{len(group)}:{digest}:{group[0]}..{group[-1]}"
            requests.append(run_request(group, key, tags).with_replaced_attrs(job_name=EMBED_JOB_NAME))
            done += [(k, wanted[k]) for k in group]
        observations.mark_requested(conn, root, done, generation)
    new = sum(1 for p in todo if p.never_requested and p.checksum is not None)
    context.log.info(f"new={new} changed={len(wanted) - new} gone={len(gone)} runs={len(requests)} "
                     f"(keys in embed runs: {sum(len(g) for g in groups)})")
    return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=add,
                           cursor=encode_cursor(generation + 1))


SENSORS = [source_documents_sensor, rerun_stale_documents_sensor]
