"""A bucket run's scan compares only its buckets' files.

The scan of one bucket stats, copies in and compares only that bucket's files:
a file of another bucket that changed, or is gone, is neither read nor marked
gone by it; one of its own is. A run over every bucket filters nothing.
"""

from __future__ import annotations

import os
import time

from pipeline_assets.app import buckets, observations

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


def test_every_bucket_is_no_filter():
    assert buckets.selected(range(N), N) is None
    assert buckets.selected([3, 1, 3], N) == [1, 3]
