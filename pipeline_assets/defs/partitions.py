"""The Dagster partitions: a fixed set of document buckets (``app/buckets.py``), and for
``embeddings`` the bucket crossed with the embedding model.

``documents`` and ``chunks``: ``b000`` .. ``b063`` by default (PIPELINE_PARTITION_BUCKETS,
fixed by the database's first use; a run whose configured count differs fails with one line).
A partition is a stable slice of the corpus, so Dagster keeps a few dozen partitions at any
corpus size; single documents are selected by run config (``refresh_documents``).
``embeddings``: a ``MultiPartitionsDefinition`` of the buckets and the dynamic ``model``
dimension (the registry's active models, ``models/partitions.py``); its key reads
``b013|openai/text-embedding-3-small@1536`` (dimensions ordered by name). A range run is a
rectangle: buckets ``first..last`` times models ``first..last`` in the dynamic keys' order.
"""

from __future__ import annotations

from collections.abc import Iterable

import dagster as dg

BUCKET_PREFIX = "b"
BUCKET_DIGITS = 3


def bucket_key(bucket: int) -> str:
    return f"{BUCKET_PREFIX}{bucket:0{BUCKET_DIGITS}d}"


def bucket_index(key: str) -> int:
    if not key.startswith(BUCKET_PREFIX) or not key[len(BUCKET_PREFIX) :].isdigit():
        raise ValueError(f"{key!r} is not a bucket partition key (b000, b001, ...)")
    return int(key[len(BUCKET_PREFIX) :])


def bucket_indexes(keys: Iterable[str]) -> list[int]:
    return [bucket_index(k) for k in keys]


def bucket_partitions(bucket_count: int) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition([bucket_key(i) for i in range(bucket_count)])


def span(buckets: Iterable[int]) -> tuple[str, str]:
    """The first and last partition key of the smallest range holding ``buckets``."""
    ordered = sorted(set(buckets))
    return bucket_key(ordered[0]), bucket_key(ordered[-1])


BUCKET_DIMENSION = "bucket"
MODEL_DIMENSION = "model"
# The dynamic partition set of model ids (one per Dagster instance; shared by every bucket).
MODEL_PARTITIONS_NAME = "model"
MODEL_PARTITIONS = dg.DynamicPartitionsDefinition(name=MODEL_PARTITIONS_NAME)
# What a model id must not hold to be a key of a multi-partition (Dagster's delimiters).
KEY_DELIMITERS = frozenset("|,[]")


def embedding_partitions(bucket_count: int) -> dg.MultiPartitionsDefinition:
    return dg.MultiPartitionsDefinition(
        {BUCKET_DIMENSION: bucket_partitions(bucket_count), MODEL_DIMENSION: MODEL_PARTITIONS}
    )


def embedding_key(bucket: int | str, model_id: str) -> dg.MultiPartitionKey:
    key = bucket if isinstance(bucket, str) else bucket_key(bucket)
    return dg.MultiPartitionKey({BUCKET_DIMENSION: key, MODEL_DIMENSION: model_id})


def split_key(key: str) -> tuple[int, str]:
    """(bucket, model id) of an ``embeddings`` partition key."""
    if isinstance(key, dg.MultiPartitionKey):
        dims = key.keys_by_dimension
        return bucket_index(dims[BUCKET_DIMENSION]), dims[MODEL_DIMENSION]
    bucket, sep, model = key.partition("|")
    if not sep:
        raise ValueError(f"{key!r} is not an embeddings partition key (bucket|model)")
    return bucket_index(bucket), model


def keys_by_model(keys: Iterable[str]) -> dict[str, list[int]]:
    """The buckets of some ``embeddings`` partition keys, per model (models in first-seen order)."""
    out: dict[str, list[int]] = {}
    for key in keys:
        bucket, model = split_key(key)
        out.setdefault(model, []).append(bucket)
    return {m: sorted(set(b)) for m, b in out.items()}


def is_model_key(model_id: str) -> bool:
    """Whether a model id can be a key of the model dimension."""
    return bool(model_id) and not (KEY_DELIMITERS & set(model_id))
