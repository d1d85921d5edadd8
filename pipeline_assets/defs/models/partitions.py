"""The ``model`` dimension of ``embeddings`` follows the model registry.

The registry (``app.models``: ``models add``, ingest, the ``model_switch`` sensor) knows
nothing of Dagster. ``model_keys`` gives the dynamic partition requests that make the model
keys the registry's active models: a model added gets its column; a retired one leaves the
partition set (its history stays in the event log and comes back with ``models activate``).
The ``model_switch`` sensor applies them every tick, ``embed_after_sync`` before it requests
a run for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

from pipeline_assets.defs.partitions import MODEL_PARTITIONS, MODEL_PARTITIONS_NAME, is_model_key


def model_keys(
    instance: dg.DagsterInstance,
    active: Sequence[str],
) -> tuple[list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest], list[str]]:
    """(the requests that make the model keys ``active``, the keys in partition order after them)."""
    current = list(instance.get_dynamic_partitions(MODEL_PARTITIONS_NAME))
    wanted = [m for m in active if is_model_key(m)]
    add = [m for m in wanted if m not in current]
    gone = [m for m in current if m not in wanted]
    requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest] = []
    if add:
        requests.append(MODEL_PARTITIONS.build_add_request(add))
    if gone:
        requests.append(MODEL_PARTITIONS.build_delete_request(gone))
    return requests, [m for m in current if m in wanted] + add
