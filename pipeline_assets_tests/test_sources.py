import os
import time
from pathlib import Path

import pytest

from pipeline_assets.content.extract import ExtractError
from pipeline_assets.settings import Settings
from pipeline_assets.content.sources import (
    SourceError,
    SourceItem,
    read_guarded,
    scan_directory,
)


def _write(root: Path, rel: str, data: bytes = b"x") -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def test_scan_order_ids_and_hidden(tmp_path):
    for rel in ["b.txt", "a.txt", "sub/z.md", "sub/deeper/c.txt", "A.txt",
                ".hidden.txt", ".git/config", "sub/.secret/x.txt"]:
        _write(tmp_path, rel)
    ids = [item.document_id for item in scan_directory(tmp_path)]
    assert ids == ["A.txt", "a.txt", "b.txt", "sub/deeper/c.txt", "sub/z.md"]
    # Deterministic: a second scan is identical.
    assert ids == [item.document_id for item in scan_directory(tmp_path)]


def test_item_fields(tmp_path):
    p = _write(tmp_path, "dir one/doc.txt", b"hello")
    (item,) = list(scan_directory(tmp_path))
    assert isinstance(item, SourceItem)
    assert item.document_id == "dir one/doc.txt"
    assert item.path == p.absolute()
    assert item.size == 5
    assert item.mtime_ns == os.stat(p).st_mtime_ns
    assert item.source_uri == p.absolute().as_uri()
    assert item.source_uri.startswith("file:///") and "%20" in item.source_uri


def test_relative_root_gives_absolute_paths(tmp_path, monkeypatch):
    _write(tmp_path, "docs/a.txt")
    monkeypatch.chdir(tmp_path)
    (item,) = list(scan_directory(Path("docs")))
    assert item.path.is_absolute() and item.document_id == "a.txt"


def test_symlinks(tmp_path):
    root = tmp_path / "root"
    _write(root, "real/f.txt")
    outside = _write(tmp_path, "outside/o.txt")
    (root / "dirlink").symlink_to(root / "real", target_is_directory=True)
    (root / "loop").symlink_to(root, target_is_directory=True)
    (root / "filelink.txt").symlink_to(outside)
    (root / "broken.txt").symlink_to(tmp_path / "missing")
    ids = [i.document_id for i in scan_directory(root)]
    assert ids == ["filelink.txt", "real/f.txt"]


def test_fifo_skipped(tmp_path):
    _write(tmp_path, "a.txt")
    os.mkfifo(tmp_path / "pipe")
    assert [i.document_id for i in scan_directory(tmp_path)] == ["a.txt"]


def test_missing_root(tmp_path):
    with pytest.raises(SourceError, match="source directory not found"):
        list(scan_directory(tmp_path / "nope"))
    f = _write(tmp_path, "file.txt")
    with pytest.raises(SourceError, match="source directory not found"):
        list(scan_directory(f))


def test_scan_is_lazy(tmp_path):
    for i in range(50):
        _write(tmp_path, f"d{i:02d}/f.txt")
    it = scan_directory(tmp_path)
    assert next(it).document_id == "d00/f.txt"


def test_read_guarded_ok(tmp_path):
    _write(tmp_path, "a.txt", b"0123456789")
    (item,) = list(scan_directory(tmp_path))
    assert read_guarded(item, 10) == b"0123456789"
    with pytest.raises(ExtractError) as e:
        read_guarded(item, 9)
    assert e.value.error_class == "too_large"


def test_too_large_without_reading(tmp_path, monkeypatch):
    p = tmp_path / "big.bin"
    with open(p, "wb") as f:
        f.truncate(30 * 1024 * 1024)  # sparse 30 MB
    (item,) = list(scan_directory(tmp_path))

    def no_open(*a, **k):
        raise AssertionError("file must not be opened")

    monkeypatch.setattr("builtins.open", no_open)
    t = time.monotonic()
    with pytest.raises(ExtractError) as e:
        read_guarded(item, Settings().max_input_bytes)
    assert time.monotonic() - t < 1.0
    assert e.value.error_class == "too_large"
    assert "exceeds limit 20971520" in str(e.value)
    assert str(e.value).startswith("too_large: ")


def test_grown_file_detected(tmp_path, monkeypatch):
    p = _write(tmp_path, "a.txt", b"small")
    (item,) = list(scan_directory(tmp_path))
    # Simulate growth after the size check: stat reports 1 byte, file has 5.
    real_stat = os.stat

    class FakeStat:
        st_size = 1

    monkeypatch.setattr(os, "stat", lambda path, *a, **k: FakeStat() if Path(path) == p else real_stat(path, *a, **k))
    with pytest.raises(ExtractError, match="grew") as e:
        read_guarded(item, 3)
    assert e.value.error_class == "too_large"
