"""Each partition's own data version, also in a run over many partitions.

A run over a partition range (a sensor batch, a ``single_run`` backfill, a
rerun) returns one ``MaterializeResult`` per asset, and Dagster 1.13 copies its
one ``data_version`` onto the materialization of every partition of the range
(dagster-io/dagster#18649, #34013: no per-partition data version for
materializations). So, for a range, the asset returns its result first (Dagster
writes its per-partition events, all carrying the range's version
``range:<count>:<digest>``), then this module writes ONE MORE materialization
per partition carrying that partition's own data version, its own metadata and
the provenance Dagster's staleness check reads: the code version, and for each
upstream asset the partition's input data version and the storage id of the
upstream's latest event (``dagster/input_event_pointer/...``), exactly the tags
Dagster writes itself. The latest materialization of a partition wins, so the
UI's data version, staleness and metadata are the partition's own. A run of one
partition writes one event, with its version, as before.

The cost is one extra event per partition and asset. They are written like
Dagster writes its own range events, as one batch (``DAGSTER_EVENT_BATCH_SIZE``,
set by ``pipeline-assets dev`` and ``pipeline-assets dagster-env``), which
takes Dagster's step-context internals (``DagsterEvent.asset_materialization``
with ``DagsterEventBatchMetadata``): yielded one by one as public
``AssetMaterialization`` events they are one transaction each, ~45 ms on this
machine, 45 s per 1,000 partitions and asset, against ~2 s batched. dagster is
pinned exactly; ``test_dagster_partition_versions`` reads the versions back
from the instance's event log, so an upgrade that changes this fails there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import dagster as dg
from dagster._core.definitions.data_version import (CODE_VERSION_TAG, DATA_VERSION_IS_USER_PROVIDED_TAG,
                                                    DATA_VERSION_TAG, NULL_EVENT_POINTER,
                                                    get_input_data_version_tag, get_input_event_pointer_tag)
from dagster._core.events import DagsterEvent, DagsterEventBatchMetadata, generate_event_batch_id


@dataclass(frozen=True)
class PartitionVersion:
    """What one partition's materialization records."""

    data_version: str
    metadata: dict = field(default_factory=dict)
    # The data version of each upstream asset's same partition this one was made from.
    inputs: Mapping[dg.AssetKey, str] = field(default_factory=dict)


def digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def range_version(versions: Mapping[str, PartitionVersion]) -> str:
    """The version of a whole range (on Dagster's own events), never mistaken for one partition's."""
    pairs = (f"{k}={v.data_version}" for k, v in sorted(versions.items()))
    return f"range:{len(versions)}:{digest(*pairs)[:16]}"


def latest_storage_id(instance: dg.DagsterInstance, key: dg.AssetKey) -> int | None:
    # A source asset (extractor_version) has observations, not materializations.
    records = (instance.fetch_materializations(key, limit=1).records
               or instance.fetch_observations(key, limit=1).records)
    return records[0].storage_id if records else None


def materialize(context: dg.AssetExecutionContext,
                results: Sequence[tuple[dg.AssetKey, Mapping[str, PartitionVersion], dict]],
                ) -> Iterator[dg.MaterializeResult | DagsterEvent]:
    """Yield each asset's result; for a range, then record each partition's own version.

    ``results``: (asset key, versions, metadata) per asset of the step, upstream
    first. ``versions``: one entry per partition that has a version (keys refused
    as document ids have none and keep Dagster's range event). ``metadata``: the
    run's counts, on Dagster's events; a one-partition run gets both on one event.
    All results come before the partitions' events, so Dagster computes its own
    provenance from its own events and never warns of a version mismatch.
    """
    if len(context.partition_keys) == 1 and all(len(versions) == 1 for _, versions, _ in results):
        for asset_key, versions, metadata in results:
            (version,) = versions.values()
            yield dg.MaterializeResult(asset_key=asset_key, metadata={**metadata, **version.metadata},
                                       data_version=dg.DataVersion(version.data_version))
        return
    for asset_key, versions, metadata in results:
        yield dg.MaterializeResult(asset_key=asset_key, metadata=metadata,
                                   data_version=dg.DataVersion(range_version(versions)) if versions else None)
    # Resumed after Dagster wrote (and flushed) its events for these results.
    for asset_key, versions, _ in results:
        yield from partition_events(context, asset_key, versions)


def partition_events(context: dg.AssetExecutionContext, asset_key: dg.AssetKey,
                     versions: Mapping[str, PartitionVersion]) -> Iterator[DagsterEvent]:
    """One materialization per partition, with Dagster's provenance tags, written as one batch."""
    code_version = context.assets_def.code_versions_by_key.get(asset_key) or context.run.run_id
    upstream = {dep for v in versions.values() for dep in v.inputs}
    # Events of the upstream written up to now (this run's included): what the partition was made from.
    pointers = {dep: latest_storage_id(context.instance, dep) for dep in upstream}
    step = context.get_step_execution_context()
    batch_id = generate_event_batch_id()
    last = len(versions) - 1
    for i, (partition, version) in enumerate(versions.items()):
        tags = {CODE_VERSION_TAG: code_version}
        for dep, input_version in version.inputs.items():
            tags[get_input_data_version_tag(dep)] = input_version
            pointer = pointers.get(dep)
            tags[get_input_event_pointer_tag(dep)] = str(pointer) if pointer else NULL_EVENT_POINTER
        tags[DATA_VERSION_TAG] = version.data_version
        tags[DATA_VERSION_IS_USER_PROVIDED_TAG] = "true"
        event = dg.AssetMaterialization(asset_key=asset_key, partition=partition, tags=tags,
                                        metadata=version.metadata)
        # Logged (into the batch buffer) when built, then passed on in the step's event
        # stream, as Dagster's own range events are.
        yield DagsterEvent.asset_materialization(step, event, DagsterEventBatchMetadata(batch_id, i == last))
