"""The input windows checked: PIPELINE_CHUNK_TOKENS against the window of the configured model
and of every active model (``ChunkTooLarge`` before any provider call), the report `settings`
shows, and the truncation and refusals `status` shows per active model."""

from __future__ import annotations

import dataclasses

from psycopg_pool import ConnectionPool

from pipeline_assets.app.runtime import chunking
from pipeline_assets.providers import (
    ChunkTooLarge,
    ConfigError,
    ModelLimit,
    ModelSpec,
    check_chunk_size,
    provider_for,
    require_known_window,
)
from pipeline_assets.providers.limits import too_small
from pipeline_assets.registry import models
from pipeline_assets.settings import Settings


def check_input_limits(settings: Settings, pool: ConnectionPool, spec: ModelSpec | None = None) -> list[ModelLimit]:
    """Refuse (``ChunkTooLarge``, one line naming both numbers and PIPELINE_CHUNK_TOKENS) a chunk
    size that could exceed the window of ``spec``'s model or of any active model, and
    (``UnknownInputWindow``, one line naming PIPELINE_MODEL_MAX_INPUT_TOKENS) a ``spec`` whose
    window is not known; before any provider call. Run by `models add` and at worker start
    (`work`, `embed`, the Dagster steps that embed). Returns the limits checked."""
    if spec is not None:
        require_known_window(spec)
    with pool.connection() as conn:
        limits = {m.model_id: m for m in models.active_limits(conn)}
    if spec is not None:
        limits[spec.model_id] = ModelLimit.of(spec)
    check_chunk_size(chunking(settings)[0], limits.values())
    return sorted(limits.values(), key=lambda m: m.model_id)


def input_limit_report(settings: Settings, pool: ConnectionPool | None = None) -> dict:
    """For `settings`: PIPELINE_CHUNK_TOKENS against the configured model's window and (with a
    pool) every active model's. ``error`` is the one-line refusal, or None when every window fits."""
    limits: dict[str, ModelLimit] = {}
    roles: dict[str, str] = {}
    warnings: list[str] = []
    spec: ModelSpec | None = None
    try:
        provider = provider_for(settings.provider_config())
    except ConfigError as exc:
        warnings.append(f"the configured model cannot be checked: {exc}")
    else:
        spec = provider.spec
        limits[spec.model_id] = ModelLimit.of(spec)
        roles[spec.model_id] = "configured"
        if not spec.window_known:
            warnings.append(
                f"the input window of {spec.model_id} is unknown: `models add`, `work`, `embed` and "
                "Dagster refuse it; set PIPELINE_MODEL_MAX_INPUT_TOKENS to the server model's window"
            )
        provider.close()
    if pool is not None:
        with pool.connection() as conn:
            for limit in models.active_limits(conn):
                limits.setdefault(limit.model_id, limit)
                roles[limit.model_id] = "configured, active" if roles.get(limit.model_id) else "active"
    tokens, overlap = chunking(settings, spec)
    over = too_small(tokens, limits.values())
    rows = [
        {**dataclasses.asdict(m), "role": roles[m.model_id], "fits": m not in over}
        for m in sorted(limits.values(), key=lambda m: m.model_id)
    ]
    return {
        "chunk_tokens": tokens,
        "chunk_overlap": overlap,
        "models": rows,
        "warnings": warnings,
        "error": str(ChunkTooLarge(tokens, over[0])) if over else None,
    }


def by_active_model(pool: ConnectionPool) -> list[dict]:
    """For `status`: per active model, its window, current chunks that could exceed it, calls whose
    usage shows the provider truncating, inputs refused as too long (``registry.models.input_limits``)."""
    with pool.connection() as conn:
        return models.input_limits(conn)
