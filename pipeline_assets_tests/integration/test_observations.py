"""app/observations.py and the folder's fast walk (content/folder_source.py): the walk lists
exactly what the scan lists."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from pipeline_assets.app import observations
from pipeline_assets.content import folder_source
from pipeline_assets.content.folder_source import walk
from pipeline_assets.content.sources import SourceError, SourceItem, scan_directory


def _tricky_tree(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    outside = tmp_path / "outside.md"
    outside.write_text("outside")
    (root / "a" / "b").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.md").write_text("hidden dir")
    (root / ".dot.md").write_text("hidden file")
    (root / "top.md").write_text("top")
    (root / "50%.md").write_text("percent")
    (root / "a" / "b" / "deep.txt").write_text("deep")
    (root / "a" / "big.md").write_bytes(b"x" * 5000)
    (root / "link-in.md").symlink_to(root / "top.md")
    (root / "link-out.md").symlink_to(outside)
    (root / "link-dir").symlink_to(root / "a", target_is_directory=True)
    (root / "broken.md").symlink_to(root / "nope.md")
    os.mkfifo(root / "pipe")
    raw = os.fsencode(str(root))
    with open(raw + b"/caf\xe9.md", "wb") as f:  # not UTF-8: an escaped id
        f.write(b"latin-1 name")
    with open(raw + b"/caf%E9.md", "wb") as f:  # a real name equal to that escape: it keeps the id
        f.write(b"real name")
    return root


def test_walk_lists_exactly_what_the_scan_lists(tmp_path):
    root = _tricky_tree(tmp_path)
    scanned = {i.document_id: (i.size, i.mtime_ns, i.problem) for i in scan_directory(root)}
    walked = {}
    for doc, size, mtime_ns, found, _ in walk(root):
        assert doc not in walked, doc
        problem = found.problem if isinstance(found, SourceItem) else None
        walked[doc] = (size, mtime_ns, problem)
    assert walked == scanned
    assert {"top.md", "50%.md", "a/b/deep.txt", "link-in.md", "link-out.md", "caf%E9.md"} <= set(walked)
    assert walked["link-out.md"][2] == "outside_root"
    assert not any(d.startswith(".") or "/." in d or d.startswith("link-dir") for d in walked)


def test_walk_gives_a_path_only_where_an_escaped_name_needs_one(tmp_path):
    """A plain file at root/id carries no handle; one below a directory whose name is escaped in
    its id carries its real path, and the sensor reads it through that path."""
    root = tmp_path / "src"
    (root / "a").mkdir(parents=True)
    (root / "a" / "plain.md").write_text("plain")
    raw = os.fsencode(str(root))
    os.mkdir(raw + b"/d\xff")
    with open(raw + b"/d\xff/in.md", "wb") as f:
        f.write(b"below an undecodable name")
    listed = {o.document_id: o for o in walk(root)}
    assert set(listed) == {"a/plain.md", "d%FF/in.md"}
    assert listed["a/plain.md"].ref is None
    assert listed["d%FF/in.md"].ref == os.fsdecode(raw + b"/d\xff/in.md")
    source = folder_source.FolderSource(root)
    expected = hashlib.sha256(b"below an undecodable name").hexdigest()[
        : len(source.fingerprint(listed["a/plain.md"], 100))
    ]
    assert source.fingerprint(listed["d%FF/in.md"], 100) == expected


def test_walk_fails_like_the_scan(tmp_path):
    with pytest.raises(SourceError, match="source directory not found"):
        list(walk(tmp_path / "missing"))


def _observed(conn, root: Path) -> dict[str, tuple]:
    return {
        d: (c, s, m)
        for d, c, s, m in conn.execute(
            "SELECT document_id, checksum, size, mtime_ns FROM app.source_observations WHERE root = %s", [str(root)]
        )
    }


def _age(path: Path, seconds: float = 3600) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_scan_compares_in_the_database_and_reads_only_what_it_must(clean_db, tmp_path, monkeypatch):
    """The walk goes into a temporary table; the prefilter, the new files' placeholders and the gone
    files are decided in SQL. Read: racy new files, changed sizes or mtimes, files back after being
    gone; in batches (here of 2) with the staged rows flushed between two fetches."""
    conn = clean_db
    monkeypatch.setattr(observations, "READ_BATCH", 2)
    reads: list[str] = []
    real = folder_source.file_checksum
    monkeypatch.setattr(
        folder_source, "file_checksum", lambda item, mb: reads.append(item.document_id) or real(item, mb)
    )
    root = tmp_path / "src"
    (root / "d").mkdir(parents=True)
    for i in range(6):
        (root / "d" / f"old{i}.md").write_text(f"settled {i}")
        _age(root / "d" / f"old{i}.md")
    (root / "fresh.md").write_text("just written")  # racy: read now
    ahead = time.time() + 60  # inside the scan's racy window however late the scan starts
    os.utime(root / "fresh.md", (ahead, ahead))
    (root / "link.md").symlink_to(root / "d" / "old0.md")  # its item, not root/link.md, is read
    _age(root / "link.md")
    first = observations.scan(conn, root, max_bytes=1 << 20)
    assert (first.present, first.unread, first.hashed, first.gone) == (8, 7, 1, 0)
    assert reads == ["fresh.md"]
    seen = _observed(conn, root)
    assert all(observations.is_unread(seen[f"d/old{i}.md"][0]) for i in range(6))
    assert (
        seen["fresh.md"][0] == real(folder_source.source_item(root, "fresh.md", str(root / "fresh.md"), 12, 0), 1 << 20)
        and seen["fresh.md"][2] == 0
    )  # racy: mtime 0, read again

    reads.clear()
    for i in range(3):  # changed: read in batches of two
        (root / "d" / f"old{i}.md").write_text(f"changed {i}!")
        _age(root / "d" / f"old{i}.md")
    (root / "d" / "old5.md").unlink()
    _age(root / "fresh.md")  # settled now: read once more (its observation has mtime 0), then trusted
    os.utime(root / "link.md", (time.time() - 7200, time.time() - 7200), follow_symlinks=False)
    (root / "d" / "old0.md").touch()
    _age(root / "d" / "old0.md", 7200)
    second = observations.scan(conn, root, max_bytes=1 << 20)
    assert sorted(reads) == ["d/old0.md", "d/old1.md", "d/old2.md", "fresh.md", "link.md"]
    assert (second.hashed, second.gone, second.present) == (5, 1, 7)
    seen = _observed(conn, root)
    assert seen["d/old5.md"][0] is None
    assert not any(observations.is_unread(seen[f"d/old{i}.md"][0]) for i in range(3))
    assert seen["link.md"][0] == seen["d/old0.md"][0]  # the symlink was read through its item

    reads.clear()
    third = observations.scan(conn, root, max_bytes=1 << 20)
    assert reads == [] and (third.hashed, third.written, third.gone) == (0, 0, 0)  # the prefilter vouches


def test_a_scan_of_some_buckets_sees_only_theirs_gone_and_never_an_empty_source_as_gone(clean_db, tmp_path):
    conn = clean_db
    root = tmp_path / "src"
    root.mkdir()
    for name in ("a.md", "b.md", "c.md"):
        (root / name).write_text(name)
        _age(root / name)
    observations.scan(conn, root, max_bytes=1 << 20)
    (root / "a.md").unlink()
    (root / "b.md").unlink()
    mine = observations.scan(conn, root, max_bytes=1 << 20, keep=lambda doc: doc in ("a.md", "c.md"))
    assert (mine.present, mine.gone) == (1, 1)
    seen = _observed(conn, root)
    assert seen["a.md"][0] is None and seen["b.md"][0] is not None  # b.md is another bucket's to mark
    (root / "c.md").unlink()
    empty = observations.scan(conn, root, max_bytes=1 << 20)
    assert (empty.empty_refused, empty.gone) == (2, 0)
    assert _observed(conn, root)["c.md"][0] is not None
