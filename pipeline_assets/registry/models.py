"""Model registry: one row per model_id, with its dimension, active or retired (SQL:
sql/queries/models.sql; the per-model HNSW index: ``registry.vector_index``).

The dimension comes from the model's configuration or the first response. Every active model
gets jobs for every current chunk; one is *served* (``app.served_model``), the one search and
export read: the first registered at once, then only ``serve`` switches it (``coverage`` says
whether a model is complete enough). A retired model keeps its vectors for a grace period
(``purge_due``, ``purge``). Retiring is sticky: a run configured with a retired model is
refused (``ModelRetired``) until ``models activate``; nothing reactivates it silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pipeline_assets.providers import ConfigError, ModelLimit, ModelSpec
from pipeline_assets.registry import vector_index
from pipeline_assets.store import queries

MODELS = queries.load("models")
JOBS = queries.load("jobs")
log = logging.getLogger(__name__)


class ModelRetired(ConfigError):
    """The configured model was retired; only `models activate` brings it back."""

    def __init__(self, model_id: str) -> None:
        super().__init__(
            f"model {model_id} was retired; run `pipeline-assets models activate {model_id}` to use it again"
        )
        self.model_id = model_id


def _index_name(model_id: str) -> str:
    return vector_index.index_name(model_id)


def ensure_model(conn: psycopg.Connection, spec: ModelSpec) -> bool:
    """Register the model with its input window; return True if it was new. Raises ModelRetired for a retired one."""
    limits = {
        "model": spec.model_id,
        "max_input_tokens": spec.max_input_tokens,
        "max_chunk_tokens": spec.max_chunk_tokens,
        "tokenizer": spec.tokenizer,
    }
    row = conn.execute(
        MODELS.insert_model, {"provider": spec.provider, "name": spec.name, "dimension": spec.dimension, **limits}
    ).fetchone()
    conn.execute(MODELS.serve_first, {"model": spec.model_id})  # the first model: nothing to switch from
    if row is not None:
        return True
    conn.execute(MODELS.update_limits, limits)
    active = conn.execute(MODELS.is_active, {"model": spec.model_id}).fetchone()
    if active is not None and not active[0]:
        raise ModelRetired(spec.model_id)
    return False


def reactivate(conn: psycopg.Connection, model_id: str) -> bool:
    """Undo a retire of the model's row; True if it was retired (the caller revives its jobs)."""
    return bool(conn.execute(MODELS.reactivate, {"model": model_id}).rowcount)


def model_dimension(conn: psycopg.Connection, model_id: str) -> int | None:
    row = conn.execute(MODELS.dimension, {"model": model_id}).fetchone()
    return row[0] if row else None


def record_dimension(conn: psycopg.Connection, model_id: str, dimension: int) -> None:
    """First response of a model whose dimension was unknown: record it and index it."""
    conn.execute(MODELS.record_dimension, {"dimension": dimension, "model": model_id})


def resolve_model_id(conn: psycopg.Connection, name: str) -> str | None:
    """Map a configured model name (PIPELINE_EMBEDDING_MODEL) to its model_id."""
    row = conn.execute(MODELS.resolve_model_id, {"name": name}).fetchone()
    return row[0] if row else None


def active_model_ids(conn: psycopg.Connection) -> list[str]:
    return [r[0] for r in conn.execute(MODELS.active_model_ids)]


def active_limits(conn: psycopg.Connection) -> list[ModelLimit]:
    """Every active model's input window, as registered (the chunk size must fit each)."""
    with conn.cursor(row_factory=dict_row) as cur:
        return [ModelLimit(**row) for row in cur.execute(MODELS.active_limits)]


def input_limits(conn: psycopg.Connection) -> list[dict]:
    """Per active model (for `status`): its window, current chunks that could exceed it, calls
    whose usage shows truncation by the provider, inputs the local model refused as too long."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(MODELS.input_limits).fetchall()


def index_states(conn: psycopg.Connection) -> tuple[dict[str, str], dict[str, dict]]:
    """Each active model's vector index, described in a few words (for `status`), and the
    progress of the builds running (``vector_index.progress``), by model."""
    states: dict[str, str] = {}
    builds: dict[str, dict] = {}
    for model_id, dim in conn.execute(MODELS.active_dimensions).fetchall():
        state = vector_index.state(conn, model_id, dim)
        states[model_id] = vector_index.describe(state, dim)
        build = vector_index.progress(conn, model_id) if state == vector_index.BUILDING else None
        if build is not None:
            builds[model_id] = build
            states[model_id] += f": {vector_index.describe_progress(build)}"
    return states, builds


def model_row(conn: psycopg.Connection, model_id: str) -> dict | None:
    """A registered model's row (model_id, name, provider, dimension, active), or None."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(MODELS.model_row, {"model": model_id}).fetchone()


def list_models(conn: psycopg.Connection) -> list[dict]:
    """Every model with its job counts and its index state (see ``vector_index``)."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(MODELS.list_models).fetchall()
    for row in rows:
        row["index"] = vector_index.state(conn, row["model_id"], row["dimension"])
    return rows


def retire(conn: psycopg.Connection, model_id: str) -> int:
    """Stop wanting vectors of a model after a model change.

    New content is no longer enqueued for it and its unstarted jobs are
    superseded (a late completion is refused: the model is inactive). Its ready
    vectors stay for the grace period (then ``purge``), so ``export --model``
    still works and ``models activate`` needs no re-embedding of unchanged
    content. Until then, anything still configured with it is refused
    (``ensure_model`` raises ModelRetired). The served model is not retired
    here: the use case refuses that (``app.model_admin.retire``).
    """
    with conn.transaction():
        conn.execute(MODELS.deactivate, {"model": model_id})
        return conn.execute(JOBS.supersede_retired_model, {"model": model_id}).rowcount


# -- the served model ---------------------------------------------------------------------


@dataclass(frozen=True)
class Coverage:
    """How much of the current corpus (distinct current chunk checksums) a model has vectors for."""

    model_id: str
    wanted: int
    ready: int
    waiting: int = 0  # a job pending, on retry or held by a worker
    failed: int = 0  # dead-lettered
    no_job: int = 0  # no live job (never enqueued, superseded): `models add` / reconcile enqueues them

    @property
    def complete(self) -> bool:
        return self.ready >= self.wanted

    @property
    def missing(self) -> int:
        return max(self.wanted - self.ready, 0)

    def describe_missing(self) -> str:
        return (
            f"{self.missing} of {self.wanted} current chunk(s) have no vector "
            f"(waiting={self.waiting} failed={self.failed} no_job={self.no_job})"
        )


def coverage(conn: psycopg.Connection, model_id: str) -> Coverage:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(MODELS.coverage, {"model": model_id}).fetchone()
    assert row is not None, "the coverage aggregate returned no row"
    return Coverage(model_id=model_id, **{k: int(v) for k, v in row.items()})


def served(conn: psycopg.Connection) -> dict | None:
    """The served model's row (model_id, previous_model_id, served_at, provider, name, dimension), or None."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(MODELS.served_model).fetchone()


def served_model_id(conn: psycopg.Connection) -> str | None:
    row = served(conn)
    return row["model_id"] if row else None


def serve(conn: psycopg.Connection, model_id: str) -> tuple[bool, str | None]:
    """Make an active model the served one. Returns (changed, previous served model).

    Raises ``ConfigError`` for a model that is not active. The caller checks
    coverage first (``coverage``), in the same transaction.
    """
    row = conn.execute(MODELS.serve, {"model": model_id}).fetchone()
    if row is not None:
        return True, row[0]
    active = conn.execute(MODELS.is_active, {"model": model_id}).fetchone()
    if active is None or not active[0]:
        raise ConfigError(f"model {model_id} is not active; `pipeline-assets models activate {model_id}` first")
    return False, model_id


def model_states(conn: psycopg.Connection, grace_seconds: float) -> list[dict]:
    """Every model: active, served, retired_at, purged_at, purge_after (retired_at + grace)."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(MODELS.model_states, {"grace": float(grace_seconds)}).fetchall()


def purge_due(conn: psycopg.Connection, grace_seconds: float) -> list[str]:
    """Retired models past their grace period whose vectors are still there (never the served one)."""
    return [r[0] for r in conn.execute(MODELS.purge_due, {"grace": float(grace_seconds)})]


def purge(conn: psycopg.Connection, model_id: str) -> int | None:
    """Delete a retired model's vectors and its vector index; returns the vectors deleted
    (None: it was activated, served or purged meanwhile). ``conn`` must be in autocommit:
    the index is dropped concurrently, outside the transaction that deletes the vectors.

    Its jobs become superseded, so `models activate` revives the wanted ones.
    """
    with conn.transaction():
        if conn.execute(MODELS.purge_lock, {"model": model_id}).fetchone() is None:
            return None
        deleted = conn.execute(MODELS.purge_vectors, {"model": model_id}).rowcount
        conn.execute(MODELS.supersede_purged_jobs, {"model": model_id})
        conn.execute(MODELS.mark_purged, {"model": model_id})
    drop_purged_index(conn, model_id)
    return deleted


def drop_purged_index(conn: psycopg.Connection, model_id: str) -> bool:
    """Drop a purged model's (empty) vector index; returns whether this role could. A role
    without DDL (the worker role) leaves it to the owner's next purge (``models purge``)."""
    if not queries.scalar(conn, MODELS.may_build_index):
        log.info(
            "the vector index of purged model %s is dropped by the owner of app.embeddings "
            "(`pipeline-assets models purge` as the owner role)",
            model_id,
        )
        return False
    conn.execute(sql.SQL(MODELS.drop_index).format(name=sql.Identifier(_index_name(model_id))))
    return True
