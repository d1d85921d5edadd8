"""A bucket run costs what its bucket holds (issue 29, item 2).

The statements a one-bucket run makes (app/buckets.py, the bucket scan of
app/observations.py) find the bucket's documents and observations through the
bucket indexes (migration 044), never by hashing every document id of the
source: with 20,000 documents loaded straight into the schema and analyzed, no
plan reads app.documents or app.source_observations sequentially. And the
scan of one bucket only stats and compares that bucket's files: a file of
another bucket that changed, or is gone, is neither read nor marked gone by it.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from pipeline_assets.app import buckets, observations
from pipeline_assets.store import db, queries

DOCS = 20_000
N, BUCKET = 64, 5
ROOT = "/bucket-cost"
SEQUENTIAL = {"documents", "source_observations"}
STATEMENTS = ("unsynced", "unobserved_current", "bucket_documents", "bucket_states", "bucket_current_pks",
              "bucket_coverage")


@pytest.fixture(scope="module")
def big_source(database_url):
    conn = db.connect(database_url)
    conn.execute("TRUNCATE app.sources, app.documents, app.source_observations CASCADE")
    source_id = conn.execute("INSERT INTO app.sources (root) VALUES (%s) RETURNING source_id", (ROOT,)).fetchone()[0]
    conn.execute("INSERT INTO app.documents (source_id, document_id, source_uri, status, source_checksum)"
                 " SELECT %s, 'd/' || i || '.md', 'file:///d/' || i, 'current', sha256(i::text::bytea)"
                 " FROM generate_series(1, %s) i", (source_id, DOCS))
    conn.execute("INSERT INTO app.source_observations (root, document_id, checksum, size, mtime_ns, synced)"
                 " SELECT %s, 'd/' || i || '.md', left(encode(sha256(i::text::bytea), 'hex'), 16), 10, 1,"
                 " left(encode(sha256(i::text::bytea), 'hex'), 16) FROM generate_series(1, %s) i", (ROOT, DOCS))
    conn.execute("VACUUM ANALYZE app.documents")
    conn.execute("VACUUM ANALYZE app.source_observations")
    yield conn
    conn.execute("TRUNCATE app.sources, app.documents, app.source_observations CASCADE")
    conn.close()


def sequential_scans(conn, text: str, params: dict) -> list[str]:
    [[plan]] = conn.execute("EXPLAIN (FORMAT JSON) " + text, params).fetchall()
    found: list[str] = []

    def walk(node: dict) -> None:
        if node.get("Node Type") == "Seq Scan" and node.get("Relation Name") in SEQUENTIAL:
            found.append(node["Relation Name"])
        for child in node.get("Plans", []):
            walk(child)

    walk((plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"])
    return found


def test_a_bucket_runs_statements_read_their_bucket_through_its_index(big_source):
    conn = big_source
    params = {"root": ROOT, "n": N, "buckets": [BUCKET], "after": "", "limit": 10_000, "model": "test/x@8",
              "sample": buckets.SAMPLE_IDS}
    bucket_sql = queries.load("buckets")
    scans = {name: sequential_scans(conn, getattr(bucket_sql, name), params) for name in STATEMENTS}
    with conn.transaction():
        conn.execute(observations.OBS.walk_create)
        scans["walked_missing_in_buckets"] = sequential_scans(conn, observations.OBS.walked_missing_in_buckets,
                                                              params)
    # unsynced's probe of a file's document (in_store) may be one hashed pass over app.documents
    # when the planner expects many of the bucket's files unsynced (a first sync); its
    # observations are read through the bucket index all the same.
    scans["unsynced"] = [r for r in scans["unsynced"] if r != "documents"]
    assert {name: found for name, found in scans.items() if found} == {}


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
        return observations.scan(conn, root.resolve(), max_bytes=1 << 20,
                                 keep=lambda d: buckets.bucket_of(d, N) == BUCKET, buckets=([BUCKET], N))

    observations.scan(conn, root.resolve(), max_bytes=1 << 20)   # every file observed (and read) once
    write_settled(root / others[0], "changed, and longer than before\n")
    os.remove(root / others[1])
    write_settled(root / mine[0], "changed, and longer than before\n")
    done = scan_bucket()
    assert (done.present, done.hashed, done.gone) == (len(mine), 1, 0)
    rows = dict(conn.execute("SELECT document_id, checksum IS NULL FROM app.source_observations").fetchall())
    assert rows[others[1]] is False     # gone from disk, but another bucket's: not marked gone by this scan
    os.remove(root / mine[1])
    assert scan_bucket().gone == 1
