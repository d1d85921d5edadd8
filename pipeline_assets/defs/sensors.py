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
stays out of the cursor and is picked up by the next tick.

Run keys. A one-document run has ``run_key = f"{document_id}:{checksum}@g{n}"``
and a batch ``"batch@g{n}:{count}:{digest}:{first}..{last}"`` (the digest covers
every document:checksum pair). ``n`` is the cursor generation the tick started
from, so a re-evaluation of the same tick (daemon crash before the cursor was
saved, a duplicate observation) yields the same keys and Dagster launches
nothing, while a later revert of a file to earlier bytes (A -> B -> A) is a new
observation and does run: a bare ``document:checksum`` key would be refused as
a duplicate there and leave B's vectors served until the next reconcile.
"""

import hashlib
import json
from pathlib import Path

import dagster as dg

from pipeline_assets.app.ingest import ingest_documents
from pipeline_assets.content.sources import SourceError, SourceItem, scan_directory
from pipeline_assets.defs.assets import DOCUMENT_PARTITIONS, PARTITIONS_NAME, partition_key_problem
from pipeline_assets.defs.rerun_sensor import rerun_stale_documents_sensor
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.defs.run_requests import (EMBED_JOB, MAX_KEYS_PER_TICK, MAX_RUNS_PER_TICK, TRIGGER_TAG,
                                               batch_digest, contiguous_groups, run_request)

__all__ = ["EMBED_JOB", "MAX_KEYS_PER_TICK", "SENSORS", "contiguous_groups", "decode_cursor", "encode_cursor",
           "source_documents_sensor"]

CHECKSUM_HEX = 16          # 64-bit prefix of sha256: enough to tell versions of one document apart
CURSOR_VERSION = 1

# (path, size, mtime_ns) -> checksum, so a tick re-reads only files that changed.
# Lives as long as the code server process; a cold cache costs one read per file.
_checksum_cache: dict[tuple[str, int, int], str] = {}
_CACHE_MAX = 500_000


# -- cursor -------------------------------------------------------------------

def decode_cursor(raw: str | None) -> tuple[int, dict[str, str]]:
    """(generation, {document_id: checksum}); an unreadable cursor counts as empty."""
    if not raw:
        return 0, {}
    try:
        data = json.loads(raw)
        if data.get("v") == CURSOR_VERSION:
            return int(data["g"]), dict(data["d"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return 0, {}


def encode_cursor(generation: int, docs: dict[str, str]) -> str:
    return json.dumps({"v": CURSOR_VERSION, "g": generation, "d": docs}, separators=(",", ":"), sort_keys=True)


# -- observation ---------------------------------------------------------------
def file_checksum(item: SourceItem, max_bytes: int) -> str | None:
    """sha256 prefix of the bytes, or of size+mtime for files the core will not read; None if unreadable."""
    key = (str(item.path), item.size, item.mtime_ns)
    hit = _checksum_cache.get(key)
    if hit is not None:
        return hit
    h = hashlib.sha256()
    if item.problem:
        # Out of the source root: quarantined without being read; never read here either.
        h.update(f"{item.problem}:{item.size}:{item.mtime_ns}".encode())
    elif item.size > max_bytes:
        # Quarantined as too large without being read; do not read it here either.
        h.update(f"oversize:{item.size}:{item.mtime_ns}".encode())
    else:
        try:
            with open(item.path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        except OSError:
            return None
    value = h.hexdigest()[:CHECKSUM_HEX]
    if len(_checksum_cache) >= _CACHE_MAX:
        _checksum_cache.clear()
    _checksum_cache[key] = value
    return value


def observe(root: Path, previous: dict[str, str], log, max_bytes: int) -> dict[str, str]:
    """{document_id: checksum} of the source now. Raises SourceError if it cannot be listed."""
    observed: dict[str, str] = {}
    refused: list[str] = []
    for item in scan_directory(root):
        if partition_key_problem(item.document_id):
            refused.append(item.document_id)
            continue
        checksum = file_checksum(item, max_bytes)
        if checksum is None:
            # Unreadable right now: neither changed nor deleted; look again next tick.
            if item.document_id in previous:
                observed[item.document_id] = previous[item.document_id]
            continue
        observed[item.document_id] = checksum
    if refused:
        log.warning(f"skipping {len(refused)} document(s) whose ids cannot be partition keys "
                    f"(they contain '|', '...' or control characters): {refused[:5]}")
    return observed


# -- batching -------------------------------------------------------------------
# -- (a) source changes ------------------------------------------------------------
@dg.sensor(name="source_documents", job=EMBED_JOB, minimum_interval_seconds=30,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Scans the source directory; adds partitions for new documents, deletes (and "
                       "tombstones) vanished ones, and requests batched runs for new and changed ones.")
def source_documents_sensor(context: dg.SensorEvaluationContext, postgres: PostgresResource,
                            embedding_provider: EmbeddingProviderResource,
                            source: SourceDirectoryResource) -> dg.SensorResult | dg.SkipReason:
    generation, seen = decode_cursor(context.cursor)
    settings = embedding_provider.settings()
    root = source.root_path(settings)
    if not root.is_dir():
        return dg.SkipReason(f"source directory {root} not found; nothing is deleted on that account")
    try:
        observed = observe(root, seen, context.log, settings.max_input_bytes)
    except SourceError as exc:
        return dg.SkipReason(f"cannot scan {root}: {exc}")
    if not observed and seen:
        return dg.SkipReason(f"source {root} is empty but {len(seen)} documents were seen before; refusing "
                             "to delete them all (clear the sensor cursor if this is intended)")

    budget = MAX_KEYS_PER_TICK
    deleted = sorted(set(seen) - set(observed))[:budget]
    budget -= len(deleted)
    changed = sorted(k for k, c in observed.items() if k in seen and seen[k] != c)[:budget]
    budget -= len(changed)
    new = sorted(k for k in observed if k not in seen)[:budget]
    if not (deleted or changed or new):
        return dg.SkipReason(f"no change among {len(observed)} documents")

    existing = context.instance.get_dynamic_partitions(PARTITIONS_NAME)
    existing_set = set(existing)
    deleted_set = set(deleted)
    to_add = sorted(k for k in (*changed, *new) if k not in existing_set)
    order = [k for k in existing if k not in deleted_set] + to_add
    groups = contiguous_groups(order, set(changed) | set(new))[:MAX_RUNS_PER_TICK]

    if deleted:
        # Tombstone in the core first: chunks dropped, unwanted vectors superseded.
        report = ingest_documents(embedding_provider.runtime(), postgres.pool(), root, deleted)
        context.log.info(f"tombstoned {report.deleted} document(s), superseded {report.superseded} job(s)")

    requests = []
    docs = dict(seen)
    for key in deleted:
        docs.pop(key, None)
    tags = {TRIGGER_TAG: "source_documents"}
    for group in groups:
        if len(group) == 1:
            key = f"{group[0]}:{observed[group[0]]}@g{generation}"
        else:
            digest = batch_digest((k, observed[k]) for k in group)
            key = f"batch@g{generation}:{len(group)}:{digest}:{group[0]}..{group[-1]}"
        requests.append(run_request(group, key, tags))
        docs.update({k: observed[k] for k in group})

    partition_requests = []
    if to_add:
        partition_requests.append(DOCUMENT_PARTITIONS.build_add_request(to_add))
    gone = [k for k in deleted if k in existing_set]
    if gone:
        partition_requests.append(DOCUMENT_PARTITIONS.build_delete_request(gone))
    context.log.info(f"new={len(new)} changed={len(changed)} deleted={len(deleted)} "
                     f"runs={len(requests)} (keys in runs: {sum(len(g) for g in groups)})")
    return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=partition_requests,
                           cursor=encode_cursor(generation + (1 if requests else 0), docs))


SENSORS = [source_documents_sensor, rerun_stale_documents_sensor]
