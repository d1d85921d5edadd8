"""app/observations.py: the source sensor's fast walk lists exactly what the scan lists."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline_assets.app.observations import SourceItem, walk
from pipeline_assets.content.sources import SourceError, scan_directory


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
    with open(raw + b"/caf\xe9.md", "wb") as f:      # not UTF-8: an escaped id
        f.write(b"latin-1 name")
    with open(raw + b"/caf%E9.md", "wb") as f:       # a real name equal to that escape: it keeps the id
        f.write(b"real name")
    return root


def test_walk_lists_exactly_what_the_scan_lists(tmp_path):
    root = _tricky_tree(tmp_path)
    scanned = {i.document_id: (i.size, i.mtime_ns, i.problem) for i in scan_directory(root)}
    walked = {}
    for doc, size, mtime_ns, found in walk(root):
        assert doc not in walked, doc
        problem = found.problem if isinstance(found, SourceItem) else None
        walked[doc] = (size, mtime_ns, problem)
    assert walked == scanned
    assert {"top.md", "50%.md", "a/b/deep.txt", "link-in.md", "link-out.md", "caf%E9.md"} <= set(walked)
    assert walked["link-out.md"][2] == "outside_root"
    assert not any(d.startswith(".") or "/." in d or d.startswith("link-dir") for d in walked)


def test_walk_fails_like_the_scan(tmp_path):
    with pytest.raises(SourceError, match="source directory not found"):
        list(walk(tmp_path / "missing"))
