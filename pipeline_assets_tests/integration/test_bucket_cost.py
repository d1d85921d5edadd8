"""A bucket run's scan compares only its buckets' files.

The scan of one bucket stats, copies in and compares only that bucket's files:
a file of another bucket that changed, or is gone, is neither read nor marked
gone by it; one of its own is. A run over every bucket filters nothing.
"""

from __future__ import annotations

import os
import time

from psycopg_pool import ConnectionPool

from pipeline_assets.app import buckets, observations
from pipeline_assets.content.folder_source import walk
from pipeline_assets.content.source import NOT_STATED
from pipeline_assets.store import bucket_rows, queries, source_observations
from pipeline_assets_tests.data_helpers import bucket_documents

DOCS = queries.load("documents")

N, BUCKET = 64, 5


def write_settled(path, text: str) -> None:
    """Write a file modified an hour ago (outside the scan's racy-mtime window)."""
    path.write_text(text)
    past = time.time_ns() - 3600 * 10**9
    os.utime(path, ns=(past, past))


def test_the_scan_of_one_bucket_compares_only_its_files(clean_db, tmp_path):
    """Files of other buckets are neither stat'ed, read nor marked gone by a bucket's scan."""
    conn = clean_db
    root = tmp_path / "src"
    root.mkdir()
    names = [f"f{i}.md" for i in range(200)]
    for name in names:
        write_settled(root / name, f"# {name}\n")
    mine = [d for d in names if buckets.bucket_of(d, N) == BUCKET]
    others = [d for d in names if buckets.bucket_of(d, N) != BUCKET]
    assert mine and others

    def scan_bucket() -> observations.Scan:
        return observations.scan(
            conn,
            root.resolve(),
            max_bytes=1 << 20,
            keep=lambda d: buckets.bucket_of(d, N) == BUCKET,
            in_buckets=([BUCKET], N),
        )

    observations.scan(conn, root.resolve(), max_bytes=1 << 20)  # every file observed (and read) once
    write_settled(root / others[0], "changed, and longer than before\n")
    os.remove(root / others[1])
    write_settled(root / mine[0], "changed, and longer than before\n")
    done = scan_bucket()
    assert (done.present, done.hashed, done.gone) == (len(mine), 1, 0)
    rows = dict(conn.execute("SELECT document_id, checksum IS NULL FROM app.source_observations").fetchall())
    assert rows[others[1]] is False  # gone from disk, but another bucket's: not marked gone by this scan
    os.remove(root / mine[1])
    assert scan_bucket().gone == 1


def test_every_bucket_is_no_filter():
    assert bucket_rows.selected(range(N), N) is None
    assert bucket_rows.selected([3, 1, 3], N) == [1, 3]


def test_bucket_of_is_the_sql_function(clean_db):
    """Python's bucket of an id is SQL's app.document_bucket, for any id and count."""
    ids = [f"d{i}/{'é' * (i % 3)}naïve-文書-{i}.txt" for i in range(1500)]
    ids += ["", "a", "\U0001d518nicode \U0001f642", "tab\tand\nnewline", "x" * 500, "bad\udcffbyte"[:3]]
    for n in (1, 7, 64, 4096):
        rows = dict(
            clean_db.execute("SELECT d, app.document_bucket(d, %s) FROM unnest(%s::text[]) AS d", (n, ids)).fetchall()
        )
        assert {d: buckets.bucket_of(d, n) for d in ids} == rows


def _nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _rows_read(plan: dict, tables: set[str]) -> int:
    """Rows the plan's scans of ``tables`` produced or filtered out, over all their loops."""
    return sum(
        (n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0) + n.get("Rows Removed by Index Recheck", 0))
        * n.get("Actual Loops", 1)
        for n in _nodes(plan)
        if n.get("Relation Name") in tables
    )


def test_one_bucket_statements_read_only_its_rows(clean_db):
    """A bucket's statements read its documents and observed files through their stored bucket,
    not every row of the source: what they read is about what the bucket holds, not the corpus."""
    conn = clean_db
    docs = 6400
    root = "/corpus"
    ids = _observed_corpus(conn, root, docs)
    conn.execute("ANALYZE app.documents")
    conn.execute("ANALYZE app.source_observations")
    mine = sum(buckets.bucket_of(d, N) == BUCKET for d in ids)
    params = {"root": root, "n": N, "buckets": [BUCKET], "sample": 20, "model": "m", "after": "", "limit": docs}
    for name, tables in (
        ("bucket_current_pks", {"documents"}),
        ("bucket_states", {"documents"}),
        ("unobserved_current", {"documents"}),
        ("unsynced", {"source_observations"}),
    ):
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + getattr(bucket_rows.BUCKETS, name), params).fetchone()[
            0
        ][0]["Plan"]
        assert _rows_read(plan, tables) <= 2 * mine, (name, mine, plan)
    assert len(bucket_documents(conn, root, [BUCKET], N)) == mine


def test_a_bucket_scan_compares_only_its_buckets_observations(clean_db):
    """A bucket scan's comparison reads that bucket's observations through the bucket index, not
    every observation of the source, and finds the bucket's gone files among them."""
    conn = clean_db
    docs = 6400
    root = "/corpus"
    ids = _observed_corpus(conn, root, docs)
    conn.execute("ANALYZE app.source_observations")
    mine = [d for d in ids if buckets.bucket_of(d, N) == BUCKET]
    with conn.transaction():
        source_observations.walk(conn, ((d, 1, 1, True, None) for d in mine[1:]))  # mine[0] is gone
        params = {"root": root, "n": N, "buckets": [BUCKET]}
        statement = source_observations.OBS.walk_diff_in_buckets.split(" AS\n", 1)[1]
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params).fetchone()[0][0]["Plan"]
        assert _rows_read(plan, {"source_observations"}) <= 2 * len(mine), (len(mine), plan)
        source_observations.diff(conn, root, ([BUCKET], N))
        assert source_observations.walked_missing(conn) == [mine[0]]


def test_the_statements_of_a_run_after_an_edit_read_the_edit_not_the_buckets(clean_db):
    """Of 6,400 synced documents in 64 buckets, 3 changed: the run over 18 buckets finds them through
    an index (not by reading the buckets' observed files), learns that no live document has another
    extractor or chunker version from a few index descents (not by reading the documents), and finds
    the documents without an observed file by merging two indexes, visiting no row of either table."""
    conn = clean_db
    docs = 6400
    root = "/corpus"
    ids = _observed_corpus(conn, root, docs)
    conn.execute("UPDATE app.source_observations SET synced = checksum")
    changed = ids[:3]
    conn.execute(
        "UPDATE app.source_observations SET checksum = 'fedcba9876543210' WHERE document_id = ANY(%s)", (changed,)
    )
    conn.execute("VACUUM ANALYZE app.documents")
    conn.execute("VACUUM ANALYZE app.source_observations")
    wanted = sorted({buckets.bucket_of(d, N) for d in changed} | set(range(0, 64, 4)))[:18]
    params = {"root": root, "n": N, "buckets": wanted, "after": "", "limit": docs}
    in_buckets = sum(buckets.bucket_of(d, N) in wanted for d in ids)

    def explained(name: str) -> dict:
        statement = getattr(bucket_rows.BUCKETS, name)
        return conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params).fetchone()[0][0]["Plan"]

    tables = {"documents", "source_observations"}
    plan = explained("unsynced")
    assert _rows_read(plan, {"source_observations"}) <= len(changed), plan
    assert sorted(r[0] for r in conn.execute(bucket_rows.BUCKETS.unsynced, params)) == changed
    plan = explained("live_versions")
    assert _rows_read(plan, {"documents"}) <= 4, plan  # one combination here, and the descent past it
    assert bucket_rows.live_versions(conn, root) == {("md", "c1", ".md")}
    plan = explained("unobserved_current")
    read = [n for n in _nodes(plan) if n.get("Relation Name") in tables and _rows_read(n, tables)]
    assert read and all(n["Node Type"] == "Index Only Scan" for n in read), [n["Node Type"] for n in read]
    assert sum(n.get("Heap Fetches", 0) for n in read) == 0, plan
    assert _rows_read(plan, tables) <= 2 * in_buckets
    conn.execute("DELETE FROM app.source_observations WHERE document_id = %s", (ids[-1],))
    assert bucket_rows.unobserved_current(conn, root, wanted, N) == (
        [ids[-1]] if buckets.bucket_of(ids[-1], N) in wanted else []
    )


def _observed_corpus(conn, root: str, docs: int) -> list[str]:
    """``docs`` documents of ``root`` in N buckets, each with an observed file (not yet synced)."""
    conn.execute(bucket_rows.BUCKETS.store_buckets, {"buckets": N})
    ids = [f"doc-{i:05d}.md" for i in range(docs)]
    _register(conn, root, ids)
    with conn.transaction():
        conn.execute(source_observations.OBS.stage_create)
        with conn.cursor().copy(source_observations.OBS.stage_copy) as copy:
            for d in ids:
                copy.write_row((d, "0123456789abcdef", 1, 1))
        conn.execute(source_observations.OBS.upsert_staged, {"root": root})
    return ids


def _register(conn, root: str, ids: list[str]) -> None:
    source = conn.execute(DOCS.register_source, {"root": root, "kind": "folder"}).fetchone()[0]
    k = len(ids)
    conn.execute(
        DOCS.write_documents,
        {
            "source": source,
            "chunker": "c1",
            "config": "cfg",
            "run": None,
            "ids": ids,
            "uris": ids,
            "checksums": [b"x"] * k,
            "sizes": [1] * k,
            "text_checksums": [b"t"] * k,
            "counts": [0] * k,
            "classes": [None] * k,
            "messages": [None] * k,
            "exts": ["md"] * k,
            "tokens": [None] * k,
        },
    )


def test_rows_without_a_stored_bucket_are_found_then_filled(clean_db, database_url):
    """Documents written before the scheme existed have no stored bucket: a bucket's statements
    still find them (by the hash), fill_buckets stores theirs, and a scheme change clears them."""
    conn = clean_db
    ids = [f"early-{i}.md" for i in range(300)]
    _register(conn, "/early", ids)  # no scheme yet: written without a bucket
    assert conn.execute("SELECT count(*) FROM app.documents WHERE bucket IS NULL").fetchone()[0] == 300
    conn.execute(bucket_rows.BUCKETS.store_buckets, {"buckets": N})
    mine = sorted((d for d in ids if buckets.bucket_of(d, N) == BUCKET), key=str.encode)
    assert bucket_documents(conn, "/early", [BUCKET], N) == mine
    with ConnectionPool(database_url, min_size=1, max_size=1, open=True) as pool:
        assert bucket_rows.fill_buckets(pool) == 300
        assert bucket_rows.fill_buckets(pool) == 0
    stored = dict(conn.execute("SELECT document_id, bucket FROM app.documents").fetchall())
    assert stored == {d: buckets.bucket_of(d, N) for d in ids}
    assert bucket_documents(conn, "/early", [BUCKET], N) == mine
    conn.execute("DELETE FROM app.partition_scheme")
    assert conn.execute("SELECT count(*) FROM app.documents WHERE bucket IS NOT NULL").fetchone()[0] == 0


def test_a_bucket_walk_lists_every_file_but_examines_only_its_own(tmp_path):
    """The folder walk of a bucket scan lists other buckets' files unexamined (NOT_STATED: no
    lstat), so the scan can still tell an emptied source from a bucket without files."""
    names = [f"w{i}.txt" for i in range(100)]
    for name in names:
        (tmp_path / name).write_text("abc")
    mine = {d for d in names if buckets.bucket_of(d, N) == BUCKET}
    walked = {doc: size for doc, size, *_ in walk(tmp_path, lambda d: d in mine)}
    assert set(walked) == set(names)
    assert {d for d, size in walked.items() if size != NOT_STATED} == mine
    assert all(walked[d] == 3 for d in mine)
