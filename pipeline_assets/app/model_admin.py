"""Model use cases: add a model (jobs for every current chunk), serve it once it
covers the corpus, retire the replaced one (its vectors deleted after a grace
period), activate a retired one again, list models, build a model's vector index.

Several models may be active; one is *served*: ``search`` and ``export`` read
it (``model_runtime.served_runtime``, ``served_model_id``). A switch is one UPDATE of one
row (``registry.models.serve``), taken only when the new model has a vector for every
current chunk, so search never answers from a half-built model, nor nothing. The switch the
Dagster layer follows: app/model_follow.py; the input windows checked: app/input_limits.py.
"""

from __future__ import annotations

import dataclasses

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import estimate, input_limits, model_runtime
from pipeline_assets.jobqueue import transitions
from pipeline_assets.providers import (
    ConfigError,
)
from pipeline_assets.registry import models, vector_index
from pipeline_assets.settings import Settings
from pipeline_assets.store import db, documents


class NotCovered(ConfigError):
    """`models serve` of a model that lacks vectors for some current chunks (without --force)."""

    def __init__(self, cov: models.Coverage) -> None:
        super().__init__(
            f"model {cov.model_id} does not cover the corpus yet: {cov.describe_missing()}; "
            "search stays on the served model (wait for its workers, or --force)"
        )
        self.coverage = cov


class ServedModel(ConfigError):
    """`models retire` of the served model: search would have nothing to read."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"model {model_id} is served; `pipeline-assets models serve OTHER` first")


def resolve(pool: ConnectionPool, name: str) -> str:
    """The model_id of a model name or id known to the database (ConfigError if unknown)."""
    with pool.connection() as conn:
        model_id = models.resolve_model_id(conn, name)
    if model_id is None:
        raise ConfigError(f"unknown model {name!r}")
    return model_id


def list_models(pool: ConnectionPool, grace_seconds: float = Settings.model_retire_grace) -> list[dict]:
    """Every model with its job counts, its index state (``index``: see ``registry.vector_index``),
    whether it is served, its coverage (active ones) and its retirement (retired_at, purge_after, purged_at)."""
    with pool.connection() as conn:
        rows = models.list_models(conn)
    states = {s["model_id"]: s for s in model_states(pool, grace_seconds)}
    for row in rows:
        row["index_detail"] = vector_index.describe(row["index"], row["dimension"])
        state = states.get(row["model_id"], {})
        row.update({k: state.get(k) for k in ("served", "coverage", "retired_at", "purge_after", "purged_at")})
    return rows


def retire(pool: ConnectionPool, name: str) -> tuple[str, int]:
    """Stop embedding new content with a model; returns (model_id, unstarted jobs superseded).

    Refused (``ServedModel``) for the served model. Its vectors and index stay
    for PIPELINE_MODEL_RETIRE_GRACE; then reconcile deletes them (``purge_expired``).
    """
    model_id = resolve(pool, name)
    with pool.connection() as conn, conn.transaction():
        if models.served_model_id(conn) == model_id:
            raise ServedModel(model_id)
        return model_id, models.retire(conn, model_id)


def activate(pool: ConnectionPool, name: str, *, max_attempts: int) -> dict:
    """Undo `models retire`: workers and ingests may use the model again.

    Returns the model id, whether it was retired, and the jobs revived and
    enqueued for content it now lacks (what the next worker will bill).
    """
    model_id = resolve(pool, name)
    with pool.connection() as conn, conn.transaction():
        documents.write_lock(conn)  # as reconcile's repairs: no ingest replaces chunks meanwhile
        was_retired, revived, enqueued = reactivate(conn, model_id, max_attempts)
    return {"model_id": model_id, "was_retired": was_retired, "revived": revived, "enqueued": enqueued}


def reactivate(conn: psycopg.Connection, model_id: str, max_attempts: int) -> tuple[bool, int, int]:
    """Undo a retire in one transaction. Returns (was retired, jobs revived, jobs enqueued).

    Its superseded jobs for content still wanted return to pending (their
    vectors were deleted when superseded), and content ingested while it was
    retired gets jobs. Unchanged content whose jobs stayed ready costs nothing.
    """
    with conn.transaction():
        if not models.reactivate(conn, model_id):
            return False, 0, 0
        revived = transitions.revive_wanted(conn)
        enqueued = transitions.enqueue_missing(conn, max_attempts)
    return True, revived, enqueued


def build_index(pool: ConnectionPool, name: str, settings: Settings) -> dict:
    """Build a model's vector index now (concurrently: completions keep committing).

    On its own connection, outside any transaction. Raises
    ``vector_index.IndexBuildError`` (one line) when the database refuses it.
    """
    model_id = resolve(pool, name)
    with pool.connection() as conn:
        dimension = models.model_dimension(conn, model_id)
    if not dimension:
        return {
            "model_id": model_id,
            "index": vector_index.NO_VECTORS,
            "detail": vector_index.describe(vector_index.NO_VECTORS, None),
        }
    with db.pool_connect(pool) as conn:
        outcome = vector_index.build(
            conn, model_id, int(dimension), memory_cap=settings.index_build_memory, session=settings.prepare
        )
    return {"model_id": model_id, "index": outcome, "detail": vector_index.describe(outcome, int(dimension))}


def add(settings: Settings, pool: ConnectionPool, name: str, *, dimensions: int | None = None) -> dict:
    """`models add`: register a model and enqueue every current chunk for it.

    Search keeps reading the served model; `serve` switches once this one
    covers the corpus. A retired model is refused (``ModelRetired``: activate
    it instead), and so is one whose input window PIPELINE_CHUNK_TOKENS could
    exceed, or that of another active model (``ChunkTooLarge``). Workers
    configured with the model do its jobs.
    """
    rt = model_runtime.runtime_for_model(settings, name, dimensions)
    input_limits.check_input_limits(settings, pool, rt.provider.spec)
    with pool.connection() as conn, conn.transaction():
        documents.write_lock(conn)  # as reconcile's repairs: no ingest replaces chunks meanwhile
        new = models.ensure_model(conn, rt.provider.spec)
        enqueued = transitions.enqueue_missing(conn, settings.max_attempts)
    with pool.connection() as conn:
        cov = models.coverage(conn, rt.model_id)
        served = models.served_model_id(conn)
    return {
        "model_id": rt.model_id,
        "new": new,
        "enqueued": enqueued,
        "served": served == rt.model_id,
        "coverage": dataclasses.asdict(cov),
    }


def add_estimate(
    settings: Settings, pool: ConnectionPool, name: str, *, dimensions: int | None = None
) -> estimate.Estimate:
    """`models add --dry-run`: what adding the model would send (every current chunk's distinct
    content without a vector for it), refused as `add` would be; writes nothing."""
    rt = model_runtime.runtime_for_model(settings, name, dimensions)
    input_limits.check_input_limits(settings, pool, rt.provider.spec)
    with pool.connection() as conn:
        row = models.model_row(conn, rt.model_id)
    if row is not None and not row["active"]:
        raise models.ModelRetired(rt.model_id)
    return estimate.for_corpus(pool, rt.provider.spec, settings.price_per_million_tokens)


def serve(pool: ConnectionPool, name: str, *, force: bool = False) -> dict:
    """`models serve`: switch search and export to a model once it covers every current chunk.

    Checked and switched in one transaction under the ingest write lock, so no
    chunk arrives between the check and the switch. Without ``force`` a model
    with any current chunk lacking a vector is refused (``NotCovered``, saying
    what is missing) and the served model stays; with it the switch happens and
    the result says what is missing (search then misses those chunks until
    their vectors arrive).
    """
    model_id = resolve(pool, name)
    with pool.connection() as conn, conn.transaction():
        documents.write_lock(conn)
        cov = models.coverage(conn, model_id)
        if not cov.complete and not force:
            raise NotCovered(cov)
        changed, previous = models.serve(conn, model_id)
    return {
        "model_id": model_id,
        "changed": changed,
        "previous": previous,
        "coverage": dataclasses.asdict(cov),
        "missing": cov.missing,
        "missing_detail": cov.describe_missing() if cov.missing else "",
    }


def served_model_id(pool: ConnectionPool) -> str | None:
    """The model search and export read (None before any model was registered)."""
    with pool.connection() as conn:
        return models.served_model_id(conn)


def active_model_ids(pool: ConnectionPool) -> list[str]:
    """The models workers and ingests embed for (registered, not retired)."""
    with pool.connection() as conn:
        return models.active_model_ids(conn)


def purge_expired(pool: ConnectionPool, grace_seconds: float) -> dict[str, int]:
    """Delete the vectors and the index of every model retired longer than the grace
    period (what reconcile runs). Returns the vectors deleted per model."""
    purged: dict[str, int] = {}
    with db.pool_connect(pool) as conn:  # autocommit: the index is dropped concurrently
        for model_id in models.purge_due(conn, grace_seconds):
            deleted = models.purge(conn, model_id)
            if deleted is not None:
                purged[model_id] = deleted
        # The indexes a role without DDL had to leave behind when it purged.
        for row in models.model_states(conn, grace_seconds):
            if row["purged_at"] and row["model_id"] not in purged and vector_index.exists(conn, row["model_id"]):
                models.drop_purged_index(conn, row["model_id"])
    return purged


def model_states(pool: ConnectionPool, grace_seconds: float) -> list[dict]:
    """Every model with its coverage, whether it is served, and its retirement (for `models list`, `status`)."""
    with pool.connection() as conn:
        states = models.model_states(conn, grace_seconds)
        for row in states:
            row["coverage"] = dataclasses.asdict(models.coverage(conn, row["model_id"])) if row["active"] else None
    return states
