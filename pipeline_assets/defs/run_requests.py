"""How the sensors turn buckets into runs: one run over a partition range of buckets
(``sync_documents``; then ``embed_documents`` over the same buckets x the active models),
with the job names, tags and run keys that let Dagster deduplicate a re-evaluated tick,
and the run statuses that count as in flight (backpressure)."""

import hashlib
from collections.abc import Iterable, Mapping

import dagster as dg

SYNC_JOB_NAME = "sync_documents"  # defs/ingest/jobs.py
EMBED_JOB_NAME = "embed_documents"  # defs/embeddings/jobs.py
# The source sensor's run after a change: both of the above for its buckets (defs/ingest/sync_and_embed.py).
SYNC_EMBED_JOB_NAME = "sync_and_embed"

TRIGGER_TAG = "pipeline/trigger"  # the sensor that asked for a run
RERUN_TAG = "pipeline/rerun"  # a rerun after a code-version bump: stale documents only
GENERATION_TAG = "pipeline/rerun_generation"  # "{epoch}.{generation}" of the rerun tick that asked
# The buckets of a source sensor's range run that hold what its tick observed pending
# ("3,17,42"): the run syncs and embeds those and records the rest of its range as it is.
PENDING_TAG = "pipeline/pending_buckets"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
PARTITION_TAG = "dagster/partition"
# The run statuses in which a run still holds (or will hold) its buckets: a
# sensor requests nothing while one of its runs is in one of them.
IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


def batch_digest(pairs: Iterable[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for doc, checksum in pairs:
        h.update(f"{doc}\x1f{checksum}\x1e".encode())
    return h.hexdigest()[:16]


def range_request(
    first: str, last: str, run_key: str, tags: dict[str, str], *, job_name: str = SYNC_JOB_NAME
) -> dg.RunRequest:
    """One run of the buckets ``first``..``last`` (one partition when they are the same)."""
    if first == last:
        return dg.RunRequest(run_key=run_key, partition_key=first, tags=tags, job_name=job_name)
    return dg.RunRequest(run_key=run_key, job_name=job_name, tags={**tags, RANGE_START_TAG: first, RANGE_END_TAG: last})


def run_span(run: dg.DagsterRun) -> tuple[str, str] | None:
    """The first and last partition key a run covered (one partition, or a range), None if neither."""
    tags = run.tags
    if RANGE_START_TAG in tags and RANGE_END_TAG in tags:
        return tags[RANGE_START_TAG], tags[RANGE_END_TAG]
    key = tags.get(PARTITION_TAG)
    return (key, key) if key else None


def encode_buckets(bucket_ids: Iterable[int]) -> str:
    """The value of PENDING_TAG: bucket numbers, ascending, comma-separated."""
    return ",".join(str(b) for b in sorted(set(bucket_ids)))


def pending_buckets(tags: Mapping[str, str]) -> list[int] | None:
    """The buckets a run's PENDING_TAG names; None without the tag (or with an unreadable one):
    the run syncs every bucket of its range."""
    value = tags.get(PENDING_TAG)
    if value is None:
        return None
    try:
        return sorted({int(part) for part in value.split(",") if part})
    except ValueError:
        return None
