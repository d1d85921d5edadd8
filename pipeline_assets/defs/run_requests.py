"""How the sensors turn partition keys into runs: one run per contiguous partition
range (see sensors.py for why), bounded per tick, with the tags and run keys
that let Dagster deduplicate a re-evaluated tick."""

import hashlib
from typing import Iterable

import dagster as dg

from pipeline_assets.defs.assets import ASSET_KEYS

EMBED_JOB_NAME = "embed_documents"
EMBED_JOB = dg.define_asset_job(
    EMBED_JOB_NAME, selection=dg.AssetSelection.assets(*ASSET_KEYS),
    description="documents -> chunks -> embeddings for one partition or a partition range.")

# Bounds per sensor tick: keys touched (added + deleted + requested), and runs requested.
# What is left over is picked up by the next tick.
MAX_KEYS_PER_TICK = 1000
MAX_RUNS_PER_TICK = 25
TRIGGER_TAG = "pipeline/trigger"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def contiguous_groups(order: Iterable[str], wanted: set[str]) -> list[list[str]]:
    """Maximal runs of consecutive keys (in partition order) that are all wanted."""
    groups: list[list[str]] = []
    current: list[str] = []
    for key in order:
        if key in wanted:
            current.append(key)
        elif current:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


def batch_digest(pairs: Iterable[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for doc, checksum in pairs:
        h.update(f"{doc}\x1f{checksum}\x1e".encode())
    return h.hexdigest()[:16]


def run_request(group: list[str], run_key: str, tags: dict[str, str]) -> dg.RunRequest:
    """One run for one partition, or for a contiguous partition range."""
    if len(group) == 1:
        return dg.RunRequest(run_key=run_key, partition_key=group[0], tags=tags)
    return dg.RunRequest(run_key=run_key, tags={**tags, RANGE_START_TAG: group[0], RANGE_END_TAG: group[-1]})
