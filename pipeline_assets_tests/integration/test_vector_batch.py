"""A completion's vectors go to the server as one binary vector[] encoded in one
numpy pass (pipeline_assets/store/vectors.py), not vector by vector through
pgvector's adapter: the server must receive exactly the same values, and
whatever does not form one (n, dim) array is sent vector by vector."""

from __future__ import annotations

import numpy as np
import psycopg
import pytest
from pgvector.psycopg import register_vector
from psycopg.types import TypeInfo

from pipeline_assets.jobqueue import transitions
from pipeline_assets.registry import models
from pipeline_assets.store import db, vectors
from pipeline_assets_tests import job_helpers
from pipeline_assets_tests.integration.test_state_machine import SPEC, seed

ROUND_TRIP = "SELECT %(v)b::vector[]"
SAME = "SELECT %(a)b::vector[] = %(b)b::vector[], cardinality(%(a)b::vector[])"


def _rows(n: int, dim: int, seed: int = 7) -> list[np.ndarray]:
    rows = list(np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32))
    extremes = np.array([-0.0, 3.4e38, 1e-45], dtype=np.float32)  # signed zero, the largest, a subnormal
    rows[0][:3] = extremes[:dim]
    return rows


@pytest.mark.parametrize("dim", [1, 3, 256, 1536])
def test_a_batch_arrives_as_the_same_vectors_pgvector_would_send(conn, dim):
    rows = _rows(5, dim)
    batch = vectors.param(conn, rows)
    assert isinstance(batch, vectors.VectorBatch)
    same, n = conn.execute(SAME, {"a": batch, "b": rows}).fetchone()
    assert (same, n) == (True, 5)
    back = conn.execute(ROUND_TRIP, {"v": batch}).fetchone()[0]
    assert [v.to_numpy().tobytes() for v in back] == [r.tobytes() for r in rows]


def test_float64_and_list_input_is_sent_as_float32(conn):
    rows = [np.array([0.5, 1.0 / 3.0, -2.0]), [1.0, 2.0, 3.0]]
    batch = vectors.param(conn, rows)
    assert isinstance(batch, vectors.VectorBatch)
    back = conn.execute(ROUND_TRIP, {"v": batch}).fetchone()[0]
    assert [v.to_list() for v in back] == [np.float32(r).tolist() for r in [rows[0], np.array(rows[1])]]


def test_what_is_not_one_array_goes_element_by_element(conn):
    mixed = [np.ones(3, dtype=np.float32), np.ones(4, dtype=np.float32)]
    assert vectors.param(conn, mixed) == mixed
    assert vectors.param(conn, []) == []
    assert conn.execute("SELECT array_length(%(v)b::vector[], 1)", {"v": vectors.param(conn, mixed)}).fetchone()[0] == 2


def test_a_nan_is_refused_by_the_server_as_before(conn):
    rows = _rows(2, 4)
    rows[1][2] = np.nan
    with pytest.raises(psycopg.errors.DataException, match="NaN"):
        conn.execute(ROUND_TRIP, {"v": vectors.param(conn, rows)})


def test_a_connection_without_the_dumper_gets_the_plain_list(database_url):
    with psycopg.connect(database_url, autocommit=True) as plain:
        register_vector(plain)  # pgvector only, as a connection made outside store.db would be
        rows = _rows(3, 4)
        assert vectors.param(plain, rows) == rows
        assert (
            plain.execute("SELECT cardinality(%(v)b::vector[])", {"v": vectors.param(plain, rows)}).fetchone()[0] == 3
        )
    with db.connect(database_url) as configured:
        assert isinstance(vectors.param(configured, rows), vectors.VectorBatch)


def test_a_completion_sends_its_vectors_as_one_batch(clean_db, database_url):
    """The completion goes through the batch dumper: on a connection that knows the
    vector type and the batch dumper but has none of pgvector's ndarray dumpers,
    a completion of numpy vectors still stores them, bit for bit."""
    models.ensure_model(clean_db, SPEC)
    jobs = seed(clean_db, 3)
    assert len(transitions.claim(clean_db, model_id=SPEC.model_id, owner="w/1", limit=10, lease_seconds=30)) == 3
    rows = _rows(3, 4)
    with psycopg.connect(database_url, autocommit=True) as bare:
        TypeInfo.fetch(bare, "vector").register(bare)
        vectors.register(bare)
        with pytest.raises(psycopg.ProgrammingError):  # no per-vector dumper on this connection
            bare.execute("SELECT %b::vector", (rows[0],))
        assert job_helpers.complete(bare, owner="w/1", job_ids=jobs, vectors=rows) == (jobs, [])
    stored = dict(
        clean_db.execute(
            "SELECT j.job_id, e.embedding FROM app.embedding_jobs j JOIN app.embeddings e"
            " USING (chunk_checksum, model_id) WHERE j.job_id = ANY(%s)",
            (jobs,),
        ).fetchall()
    )
    assert [stored[j].to_numpy().tobytes() for j in jobs] == [r.tobytes() for r in rows]
