"""Job ids and checksums go to the server as one binary array encoded in one
pass (pipeline_assets/store/arrays.py), not element by element through psycopg's
list dumper: the server must receive exactly the same values, for every
placeholder the queue's statements use them in, and a connection without the
dumpers still sends the plain list."""

from __future__ import annotations

import os
import tracemalloc

import psycopg
import pytest

from pipeline_assets.jobqueue import transitions
from pipeline_assets.store import arrays, bucket_rows, stage_runs
from pipeline_assets_tests.data_helpers import one_chunk_documents

IDS = [1, 2, 2**31, 2**62, -5, 0]
SUMS = [os.urandom(32) for _ in range(5)] + [b"", b"\x00" * 3]


@pytest.mark.parametrize("values", [IDS, [], list(range(10**6, 10**6 + 100))])
def test_ids_arrive_as_the_same_bigint_array(conn, values):
    param = arrays.int8(conn, values)
    assert isinstance(param, arrays.Int8Array)
    for placeholder in ("%(a)s::bigint[]", "%(a)b::bigint[]", "%(a)s"):
        same, back = conn.execute(
            f"SELECT {placeholder} = %(b)s::bigint[], {placeholder}", {"a": param, "b": list(values)}
        ).fetchone()
        assert (same, back) == (True, values), placeholder
    # As the queue's statements use them: a membership test and an unnest beside another array.
    assert conn.execute("SELECT 2 = ANY(%(a)s)", {"a": param}).fetchone()[0] is (2 in values)
    rows = conn.execute(
        "SELECT i, k FROM unnest(%(a)s::bigint[], %(b)s::int[]) WITH ORDINALITY AS u(i, k)",
        {"a": param, "b": [0] * len(values)},
    ).fetchall()
    assert [i for i, _ in rows] == values


@pytest.mark.parametrize("values", [SUMS, []])
def test_checksums_arrive_as_the_same_bytea_array(conn, values):
    param = arrays.bytea(conn, values)
    assert isinstance(param, arrays.ByteaArray)
    same, n, back = conn.execute(
        "SELECT %(a)b::bytea[] = %(b)b::bytea[], cardinality(%(a)b::bytea[]), %(a)b::bytea[]",
        {"a": param, "b": list(values)},
    ).fetchone()
    assert (same, n) == (True, len(values))
    assert [bytes(v) for v in back] == values


def test_a_connection_without_the_dumpers_gets_the_list(database_url):
    with psycopg.connect(database_url) as plain:
        assert arrays.int8(plain, (1, 2)) == [1, 2]
        assert arrays.bytea(plain, (b"x",)) == [b"x"]
        assert plain.execute("SELECT %s::bigint[]", [arrays.int8(plain, (1, 2))]).fetchone()[0] == [1, 2]


def test_copy_of_a_bigint_array_keeps_psycopgs_dumper(conn):
    """The dumpers are registered for their class, not as the dumpers of the array oids."""
    conn.execute("CREATE TEMP TABLE t (ids bigint[], sums bytea[])")
    with conn.cursor().copy("COPY t (ids, sums) FROM STDIN WITH (FORMAT BINARY)") as copy:
        copy.set_types(["bigint[]", "bytea[]"])
        copy.write_row(([1, 2], [b"a"]))
    assert conn.execute("SELECT ids, sums FROM t").fetchone() == ([1, 2], [b"a"])


def test_a_bucket_runs_document_keys_cost_bytes_a_key_not_an_object_each(clean_db):
    """An embeddings run over every bucket reads its current documents' keys once, holds them for its
    whole wait and sends them twice (the jobs to enqueue, the stage rows to refresh): held at 8 bytes
    a key, each send a few bytes a key (psycopg's list dumper: ~250 bytes and ~20 us a key)."""
    conn, n = clean_db, 50_000
    model_id = one_chunk_documents(conn, "/keys", n)
    tracemalloc.start()
    try:
        keys = bucket_rows.current_pks(conn, "/keys", range(64), 64)  # every bucket: no filter
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        enqueued = transitions.enqueue_for_docs(conn, keys, 3)
        written = stage_runs.refresh_embed_docs(conn, model_id, keys)  # each document's embed row
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (len(keys), enqueued, written) == (n, n, n)  # every key arrived, twice
    assert held < 16 * n, f"{held / n:.0f} bytes held a key"
    assert peak - held < 40 * n, f"{(peak - held) / n:.0f} bytes a key to send them"
