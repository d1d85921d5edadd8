"""The per-model HNSW index on app.embeddings: which kind, its state, its build.

Each model gets a partial expression index (``WHERE model_id = …``) over a cast to its dimension:
``vector`` up to 2,000 dimensions, ``halfvec`` up to 4,000 (pgvector's HNSW limits); above that it
is searched exactly. The build never blocks completions (``CREATE INDEX CONCURRENTLY``, one builder
per index under a session advisory lock; a second leaves it to the first), its memory is
``registry.index_memory``'s, and its error is one line (``IndexBuildError``). A failed or cancelled
build leaves an INVALID index the next build replaces. Workers build when their queue drains and no
ingest runs (``registry.background_build``, cancelled on stop); ``pipeline-assets models index``
on demand; until then search is an exact scan (docs/state-machine.md, "Vector indexes").
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time

import psycopg
from psycopg import sql

from pipeline_assets.messages import one_line
from pipeline_assets.registry.index_memory import build_memory, graph_bytes
from pipeline_assets.registry.registry_config import DEFAULT_INDEX_BUILD_MEMORY
from pipeline_assets.store import queries

log = logging.getLogger(__name__)

MODELS = queries.load("models")

# pgvector's HNSW index takes `vector` columns of at most this many dimensions...
HNSW_MAX_VECTOR_DIM = 2000
# ...and `halfvec` of at most this many; a model above it has no index (exact search).
HNSW_MAX_HALFVEC_DIM = 4000
# First key of the build lock (pg_try_advisory_lock(int, int)); the second is hashtext(index name).
INDEX_LOCK_NAMESPACE = 0x766E6478
# SQLSTATEs of a build that could not get that memory (shared memory of a parallel build: a small
# /dev/shm in a container): built again once with the server's own setting.
OUT_OF_BUILD_MEMORY = ("53100", "53200")  # disk_full (a DSM segment), out_of_memory

# Index states, as `models list` and `status` show them.
READY = "ready"  # a valid HNSW index: approximate nearest neighbours
BUILDING = "building"  # a builder holds the lock (searches scan exactly meanwhile)
INVALID = "invalid"  # a build failed or was cancelled; the next build drops and rebuilds it
MISSING = "missing"  # not built yet (built when a worker's queue drains): exact scan
EXACT = "exact"  # over HNSW_MAX_HALFVEC_DIM dimensions: never indexed, exact scan
NO_VECTORS = "none"  # dimension unknown: nothing embedded yet


class IndexBuildError(RuntimeError):
    """The index could not be built; the message is one line. The run goes on without it."""


class IndexNotOwned(IndexBuildError):
    """This role may not create indexes on app.embeddings (a worker role without DDL): the build
    is the schema owner's (`pipeline-assets models index` as the owner role). Not a fault."""


class IndexNeedsSession(IndexNotOwned):
    """The connection goes through a transaction-pooling PgBouncer: the build's lock and memory
    setting are a session's, and each statement may land on another server connection (the lock
    would stay held, the setting leak to another client). The build is left to a session
    connection (`pipeline-assets models index` with a direct URL). Not a fault."""


def index_name(model_id: str) -> str:
    return "embeddings_hnsw_" + hashlib.sha1(model_id.encode()).hexdigest()[:12]


def index_kind(dimension: int) -> str | None:
    """The type the index casts to: vector, halfvec, or None (too many dimensions to index)."""
    if dimension <= HNSW_MAX_VECTOR_DIM:
        return "vector"
    if dimension <= HNSW_MAX_HALFVEC_DIM:
        return "halfvec"
    return None


def search_kind(dimension: int) -> str:
    """The cast a search orders by: the index's (so the planner can use it), else full precision."""
    return index_kind(dimension) or "vector"


def describe(state: str, dimension: int | None) -> str:
    """One human line for a state, with the kind of index."""
    if state == EXACT:
        return f"exact search (no index over {HNSW_MAX_HALFVEC_DIM} dimensions)"
    if state == NO_VECTORS or dimension is None:
        return "none yet (no vectors)"
    kind = index_kind(dimension)
    return {
        READY: f"hnsw {kind}",
        BUILDING: f"hnsw {kind} building (exact search meanwhile)",
        INVALID: f"hnsw {kind} invalid (a build failed; rebuilt on the next drain)",
        MISSING: "not built yet (exact search until a worker drains after the ingests, or `models index` "
        "behind a transaction pooler)",
    }[state]


def state(conn: psycopg.Connection, model_id: str, dimension: int | None) -> str:
    """The model's index state (read-only: catalog and lock views)."""
    if not dimension:
        return NO_VECTORS
    if index_kind(int(dimension)) is None:
        return EXACT
    valid, building = queries.one_row(conn, MODELS.index_state, _lock_params(model_id))
    if building:
        return BUILDING
    return MISSING if valid is None else READY if valid else INVALID


def exists(conn: psycopg.Connection, model_id: str) -> bool:
    """Whether the model has an index, valid or not (read-only)."""
    return queries.one_row(conn, MODELS.index_state, _lock_params(model_id))[0] is not None


def progress(conn: psycopg.Connection, model_id: str) -> dict | None:
    """The running build of the model's index (pg_stat_progress_create_index: phase, blocks
    and tuples done of their totals), or None when none runs."""
    row = conn.execute(MODELS.index_build_progress, _lock_params(model_id)).fetchone()
    if row is None:
        return None
    return dict(zip(("phase", "blocks_done", "blocks_total", "tuples_done", "tuples_total"), row, strict=True))


def describe_progress(p: dict) -> str:
    """A build's progress in a few words: its phase, then what of the totals is done."""
    parts = [p["phase"]]
    for unit in ("tuples", "blocks"):
        if p[f"{unit}_total"]:
            parts.append(f"{p[unit + '_done']:,} of {p[unit + '_total']:,} {unit}")
    return ", ".join(parts)


def build(
    conn: psycopg.Connection,
    model_id: str,
    dimension: int,
    *,
    memory_cap: int = DEFAULT_INDEX_BUILD_MEMORY,
    session: bool = True,
) -> str:
    """Build the model's index concurrently if it is missing or invalid; return the state after.

    ``conn`` must be in autocommit mode with no transaction open (CREATE INDEX
    CONCURRENTLY cannot run inside one), and a session of its own (a direct
    connection, or a pooler in session mode): the build lock and the build's
    memory (``build_memory``, at most ``memory_cap`` bytes) are the session's.
    An existing valid index is left as it is (inserts maintain it). Returns
    BUILDING without waiting when another session is building it, EXACT when
    the dimension cannot be indexed. Raises IndexBuildError (one line) when the
    database refuses the build, IndexNeedsSession when ``session`` is False (``conn`` is
    transaction-pooled) and the index is not valid already: no statement of the build is sent.
    """
    kind = index_kind(int(dimension))
    if kind is None:
        return EXACT
    if not conn.autocommit or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError("an index is built concurrently, outside any transaction (use an autocommit connection)")
    name = index_name(model_id)
    params = _lock_params(model_id)
    if not session:
        if queries.one_row(conn, MODELS.index_state, params)[0]:
            return READY
        raise IndexNeedsSession(
            f"the vector index of model {model_id} is built on a session connection, not "
            "through a transaction pooler: run `pipeline-assets models index` with a direct "
            "PIPELINE_DATABASE_URL and PIPELINE_DATABASE_POOL_MODE=session"
        )
    if not queries.scalar(conn, MODELS.may_build_index):
        if queries.one_row(conn, MODELS.index_state, params)[0]:
            return READY
        raise IndexNotOwned(
            f"the vector index of model {model_id} is built by the owner of app.embeddings, "
            f"not by role {conn.info.user}: run `pipeline-assets models index` as the owner role"
        )
    if not queries.one_row(conn, MODELS.try_lock_index_build, params)[0]:
        return BUILDING
    try:
        valid, _ = queries.one_row(conn, MODELS.index_state, params)
        if valid:
            return READY
        if valid is not None:  # INVALID: left by a failed or cancelled build
            log.warning("dropping the invalid index %s of model %s and building it again", name, model_id)
            conn.execute(_drop(name))
        vectors, session_memory = (
            int(v) for v in queries.one_row(conn, MODELS.index_build_inputs, {"model": model_id})
        )
        graph = graph_bytes(vectors, int(dimension), kind)
        memory = build_memory(vectors, int(dimension), kind, session_memory=session_memory, cap=memory_cap)
        if graph > memory:
            log.warning(
                "the vector index of model %s (%d vectors) needs ~%d MB to build in memory, over "
                "PIPELINE_INDEX_BUILD_MEMORY (%d MB): it builds partly on disk, far slower",
                model_id,
                vectors,
                graph >> 20,
                memory_cap >> 20,
            )
        setting, previous = f"{max(memory >> 10, 1024)}kB", f"{session_memory >> 10}kB"
        started = time.monotonic()
        create = sql.SQL(MODELS.create_hnsw_index).format(
            name=sql.Identifier(name),
            kind=sql.Identifier(kind),
            opclass=sql.Identifier(f"{kind}_cosine_ops"),
            dim=sql.Literal(int(dimension)),
            model=sql.Literal(model_id),
        )
        try:
            try:
                conn.execute(MODELS.set_index_build_memory, {"memory": setting})
                conn.execute(create)
            except psycopg.Error as exc:
                if exc.sqlstate not in OUT_OF_BUILD_MEMORY:
                    raise
                log.warning(
                    "building the index %s with %s failed (%s); building it with the session's "
                    "maintenance_work_mem (%s)",
                    name,
                    setting,
                    one_line(exc),
                    previous,
                )
                _drop_quietly(conn, name)
                conn.execute(MODELS.set_index_build_memory, {"memory": previous})
                conn.execute(create)
            finally:
                _reset_build_memory(conn, previous)
        except psycopg.Error as exc:
            if not isinstance(exc, psycopg.errors.QueryCanceled):  # cancelled: stopping; the next build drops it
                _drop_quietly(conn, name)  # an invalid index is still maintained on every insert
            raise IndexBuildError(
                f"could not build the vector index of model {model_id} ({dimension} dimensions): {one_line(exc)}"
            ) from None
        log.info(
            "built the %s HNSW index %s of model %s (%d vectors, maintenance_work_mem %s) in %.1f s",
            kind,
            name,
            model_id,
            vectors,
            setting,
            time.monotonic() - started,
        )
        return READY
    finally:
        if not conn.closed and not conn.broken:
            with contextlib.suppress(psycopg.Error):  # the lock dies with the connection
                conn.execute(MODELS.unlock_index_build, params)


def _reset_build_memory(conn: psycopg.Connection, previous: str) -> None:
    if conn.closed or conn.broken:
        return
    with contextlib.suppress(psycopg.Error):  # the setting is the session's: it goes with the connection
        conn.execute(MODELS.set_index_build_memory, {"memory": previous})


def _lock_params(model_id: str) -> dict:
    return {"namespace": INDEX_LOCK_NAMESPACE, "name": index_name(model_id)}


def _drop(name: str) -> sql.Composed:
    return sql.SQL(MODELS.drop_index).format(name=sql.Identifier(name))


def _drop_quietly(conn: psycopg.Connection, name: str) -> None:
    try:
        conn.execute(_drop(name))
    except psycopg.Error as exc:
        log.warning("could not drop the invalid index %s (the next build will): %s", name, one_line(exc))
