"""The Dagster partitions: a fixed set of document buckets (``app/buckets.py``).

Documents, chunks and embeddings are partitioned by bucket, ``b000`` ..
``b063`` by default (PIPELINE_PARTITION_BUCKETS; the count is fixed by the
first use of the database, and a run whose configured count differs fails with
one line saying which to set). A partition is a stable slice of the corpus, not
one document: Dagster keeps the same few dozen partitions at 100 documents or
1M, so its status cache, its backfills and its UI cost what they cost for
64 partitions whatever the corpus. Single documents are selected by run config
(the ``refresh_documents`` job), not by partition.
"""

from __future__ import annotations

from collections.abc import Iterable

import dagster as dg

BUCKET_PREFIX = "b"
BUCKET_DIGITS = 3


def bucket_key(bucket: int) -> str:
    return f"{BUCKET_PREFIX}{bucket:0{BUCKET_DIGITS}d}"


def bucket_index(key: str) -> int:
    if not key.startswith(BUCKET_PREFIX) or not key[len(BUCKET_PREFIX):].isdigit():
        raise ValueError(f"{key!r} is not a bucket partition key (b000, b001, ...)")
    return int(key[len(BUCKET_PREFIX):])


def bucket_indexes(keys: Iterable[str]) -> list[int]:
    return [bucket_index(k) for k in keys]


def bucket_partitions(buckets: int) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition([bucket_key(i) for i in range(buckets)])


def span(buckets: Iterable[int]) -> tuple[str, str]:
    """The first and last partition key of the smallest range holding ``buckets``."""
    ordered = sorted(set(buckets))
    return bucket_key(ordered[0]), bucket_key(ordered[-1])
