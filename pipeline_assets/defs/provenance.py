"""Data and code versions on the materializations a step records for assets it does not own
(``refresh_documents``, the reconciliation), and the data version of a range run.

Dagster decides staleness from a materialization's provenance; one without it is compared
by timestamps only, so a code version bump would leave it FRESH. These events carry what an
asset run records: the partition's data version, the asset's code version and, per upstream
asset, its data version and the storage id of its latest event (``input_event_pointer``),
in Dagster's own tag names (``dagster/data_version`` ...).
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator, Iterable, Mapping
from typing import Any

import dagster as dg

DATA_VERSION_TAG = "dagster/data_version"
CODE_VERSION_TAG = "dagster/code_version"
INPUT_DATA_VERSION_PREFIX = "dagster/input_data_version/"
INPUT_EVENT_POINTER_PREFIX = "dagster/input_event_pointer/"
# What an asset run records for an upstream asset never observed (Dagster's own values).
UNOBSERVED_VERSION = "INITIAL"
NULL_EVENT_POINTER = "NULL"


def run_version(versions: Mapping[str, str]) -> str:
    """One partition's version, or the version of a range (never mistaken for one bucket's)."""
    if len(versions) == 1:
        return next(iter(versions.values()))
    h = hashlib.sha256()
    for key in sorted(versions):
        h.update(f"{key}={versions[key]}\x1e".encode())
    return f"range:{len(versions)}:{h.hexdigest()[:16]}"


def version_tags(
    data_version: str, code_version: str, inputs: Mapping[dg.AssetKey, tuple[str, int | None]] | None = None
) -> dict[str, str]:
    """The tags of a materialization made under ``code_version`` from ``inputs``
    (upstream asset -> (its data version, the storage id of its event))."""
    tags = {DATA_VERSION_TAG: data_version, CODE_VERSION_TAG: code_version}
    for key, (version, storage_id) in (inputs or {}).items():
        tags[INPUT_DATA_VERSION_PREFIX + key.to_user_string()] = version
        tags[INPUT_EVENT_POINTER_PREFIX + key.to_user_string()] = (
            NULL_EVENT_POINTER if storage_id is None else str(storage_id)
        )
    return tags


def high_water(instance: dg.DagsterInstance, key: dg.AssetKey) -> int:
    """The storage id of the asset's latest materialization (0 before any)."""
    records = instance.fetch_materializations(key, limit=1, ascending=False).records
    return records[0].storage_id if records else 0


def latest_observation(instance: dg.DagsterInstance, key: dg.AssetKey) -> tuple[str, int | None]:
    """(data version, storage id) of the asset's latest observation of any partition: what an
    asset run records for an observed upstream asset (Dagster compares a partition's later
    observations with the one at or before that storage id); before any, what it records then."""
    records = instance.fetch_observations(key, limit=1, ascending=False).records
    if not records:
        return UNOBSERVED_VERSION, None
    observation = records[0].asset_observation
    version = (observation.tags or {}).get(DATA_VERSION_TAG, "") if observation else ""
    return version, records[0].storage_id


def latest_since(
    instance: dg.DagsterInstance, key: dg.AssetKey, partitions: Iterable[str], after: int
) -> dict[str, int]:
    """The storage id of each partition's latest materialization recorded after ``after``
    (what this step just recorded: a bounded read, a few events per partition)."""
    keys = list(partitions)
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=keys, after_storage_id=after),
        limit=4 * len(keys) + 4,
        ascending=False,
    ).records
    out: dict[str, int] = {}
    for record in records:
        if record.partition_key is not None:
            out.setdefault(record.partition_key, record.storage_id)
    return out


# partition -> (metadata, data version)
Events = Mapping[str, tuple[Mapping[str, Any], str]]
# partition -> upstream asset -> (its data version, the storage id of its event)
Inputs = Mapping[str, Mapping[dg.AssetKey, tuple[str, int | None]]]


def versioned_events(
    instance: dg.DagsterInstance,
    asset: dg.AssetKey,
    code_version: str,
    events: Events,
    inputs: Inputs | None = None,
) -> Generator[dg.AssetMaterialization, None, dict[str, tuple[str, int]]]:
    """Yield one materialization per partition of ``events`` with its versions; return each
    partition's (data version, storage id), the inputs of what is downstream of it.

    Each event is stored when the step yields it, so the storage ids are read after the last
    one. A partition whose event cannot be found back is left out of the result: downstream
    of it, Dagster then reports a new dependency (stale), never a false FRESH."""
    after = high_water(instance, asset)
    for partition, (metadata, version) in events.items():
        yield dg.AssetMaterialization(
            asset,
            partition=partition,
            metadata=dict(metadata),
            tags=version_tags(version, code_version, (inputs or {}).get(partition)),
        )
    ids = latest_since(instance, asset, events, after)
    return {p: (events[p][1], ids[p]) for p in events if p in ids}
