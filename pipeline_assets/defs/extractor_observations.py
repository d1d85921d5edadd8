"""The ``extractor_version`` source asset: each document's format's extractor version, observed.

Extractor versions are per format (``content/extract.py``), while a Dagster code
version is one per asset. So the version a document is extracted with is an
upstream of ``documents`` instead: a partitioned source asset (same partitions)
whose data version per partition is the extractor version of that document's
format, recorded as observations. Dagster's staleness compares, partition by
partition, the observations after the one a ``documents`` materialization was
made from (its ``dagster/input_event_pointer/extractor_version`` tag) with that
one: after a PDF-only bump, a new observation of only the PDF partitions marks
exactly them stale ("has a new dependency data version").

Who observes: the ingest step, before it records provenance, for its partitions
whose latest observation is not the current version (one batch); and the rerun
sensor, for the stale partitions it found, so the UI shows them stale as soon
as the sensor sees the bump. Unchanged versions are never observed again.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import dagster as dg
from dagster._core.definitions.data_version import DATA_VERSION_IS_USER_PROVIDED_TAG, DATA_VERSION_TAG
from dagster._core.events import DagsterEvent, DagsterEventBatchMetadata, DagsterEventType, generate_event_batch_id

EXTRACTOR_VERSION = dg.AssetKey("extractor_version")


def observed_versions(instance: dg.DagsterInstance, keys: Sequence[str]) -> dict[str, str]:
    """The latest observed extractor version of each partition that has one."""
    if not keys:
        return {}
    tags = instance.event_log_storage.get_latest_tags_by_partition(
        EXTRACTOR_VERSION, DagsterEventType.ASSET_OBSERVATION, [DATA_VERSION_TAG], asset_partitions=list(keys))
    return {k: t[DATA_VERSION_TAG] for k, t in tags.items() if DATA_VERSION_TAG in t}


def changed(instance: dg.DagsterInstance, current: Mapping[str, str]) -> dict[str, str]:
    """The partitions whose current version is not the one last observed."""
    seen = observed_versions(instance, list(current))
    return {k: v for k, v in current.items() if seen.get(k) != v}


def observation(partition: str, version: str) -> dg.AssetObservation:
    return dg.AssetObservation(asset_key=EXTRACTOR_VERSION, partition=partition,
                               tags={DATA_VERSION_TAG: version, DATA_VERSION_IS_USER_PROVIDED_TAG: "true"},
                               metadata={"extractor_version": version})


def observation_events(context: dg.AssetExecutionContext, versions: Mapping[str, str]) -> Iterator[DagsterEvent]:
    """In a step: one observation per partition, written as one batch (as partition_versions does)."""
    step = context.get_step_execution_context()
    batch_id = generate_event_batch_id()
    last = len(versions) - 1
    for i, (partition, version) in enumerate(versions.items()):
        yield DagsterEvent.asset_observation(step, observation(partition, version),
                                             DagsterEventBatchMetadata(batch_id, i == last))


def report(instance: dg.DagsterInstance, versions: Mapping[str, str]) -> None:
    """Outside a run (a sensor tick): runless observations, one per partition."""
    for partition, version in versions.items():
        instance.report_runless_asset_event(observation(partition, version))
