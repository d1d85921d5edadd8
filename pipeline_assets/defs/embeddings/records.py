"""What an ``embeddings`` run records per partition and per model: the partition's data version and
metadata (its coverage), and the run's counts. Shared by the asset and the ``sync_and_embed`` job."""

from typing import Any

from pipeline_assets.app import estimate
from pipeline_assets.app.embed_selection import BucketsEmbedded
from pipeline_assets.store import bucket_rows


def embedding_version(model_id: str, state: bucket_rows.BucketState, cov: bucket_rows.BucketCoverage) -> str:
    """One ``embeddings`` partition's data version: the model, the bucket's chunks, its coverage."""
    return bucket_rows.digest([model_id, state.chunks_digest, f"{cov.ready}/{cov.chunks}"])


def coverage_metadata(cov: bucket_rows.BucketCoverage) -> dict[str, Any]:
    """One ``embeddings`` partition's metadata: its coverage and its first failed documents."""
    meta: dict[str, Any] = {"chunks": cov.chunks, "ready": cov.ready, "failed": cov.failed, "waiting": cov.waiting}
    if cov.failed_ids:
        meta["failed_ids"] = ", ".join(cov.failed_ids)
    return meta


def run_counts(est: estimate.Estimate, done: BucketsEmbedded) -> dict[str, int]:
    """What one model's part of a run estimated and did ("reused": ready vectors it did not make)."""
    work, after = done.work, done.after
    return {
        name: int(value)
        for name, value in (
            ("estimated_inputs", est.send_inputs),
            ("estimated_tokens", est.send_tokens),
            ("chunks", after.wanted),
            ("embedded", work.embedded),
            ("reused", max(after.ready - work.embedded, 0)),
            ("superseded", work.superseded),
            ("failed", after.failed),
            ("waiting", after.waiting),
            ("enqueued", done.enqueued),
            ("retried", work.retried),
            ("throttled", work.throttled),
            ("provider_calls", work.provider_calls),
            ("tokens", work.tokens),
            ("ready", after.ready),
        )
    }
