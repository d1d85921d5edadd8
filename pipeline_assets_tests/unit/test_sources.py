import os
import stat
import threading
from pathlib import Path

import pytest

from pipeline_assets.content.extract import ExtractError
from pipeline_assets.content.sources import (
    NOT_REGULAR,
    OUTSIDE_ROOT,
    SourceError,
    SourceItem,
    document_id_problem,
    escape_name,
    item_for,
    read_guarded,
    scan_directory,
    unescape_id,
)
from pipeline_assets.settings import Settings


def _write(root: Path, rel: str, data: bytes = b"x") -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def test_scan_order_ids_and_hidden(tmp_path):
    for rel in [
        "b.txt",
        "a.txt",
        "sub/z.md",
        "sub/deeper/c.txt",
        "A.txt",
        ".hidden.txt",
        ".git/config",
        "sub/.secret/x.txt",
    ]:
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
    """Only files whose real path is under the root are read: a link inside the root
    reads as its target; a link out of the root is listed as quarantined (outside_root)
    with the link's own metadata and is never opened."""
    root = tmp_path / "root"
    _write(root, "real/f.txt", b"inside")
    outside = _write(tmp_path, "outside/o.txt", b"a secret out of the root")
    (root / "dirlink").symlink_to(root / "real", target_is_directory=True)
    (root / "outdir").symlink_to(tmp_path / "outside", target_is_directory=True)
    (root / "loop").symlink_to(root, target_is_directory=True)
    (root / "self").symlink_to(root / "self")  # a link loop
    (root / "filelink.txt").symlink_to(outside)
    (root / "inlink.txt").symlink_to(root / "real" / "f.txt")
    (root / "broken.txt").symlink_to(tmp_path / "missing")
    items = {i.document_id: i for i in scan_directory(root)}
    assert list(items) == ["filelink.txt", "inlink.txt", "real/f.txt"]
    assert items["filelink.txt"].problem == OUTSIDE_ROOT
    assert items["filelink.txt"].size == os.lstat(root / "filelink.txt").st_size  # the link's, not the target's
    assert items["inlink.txt"].problem is None and read_guarded(items["inlink.txt"], 100) == b"inside"

    opened = []
    real_open = os.open
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
        with pytest.raises(ExtractError) as e:
            read_guarded(items["filelink.txt"], 100)
    assert e.value.error_class == OUTSIDE_ROOT and opened == []


def test_the_opened_file_is_checked_not_only_the_name(tmp_path):
    """A name swapped for a link out of the root after the scan (or a directory on its
    path swapped for one) is refused when read."""
    root = tmp_path / "root"
    _write(root, "a.txt", b"fine")
    _write(root, "sub/b.txt", b"fine too")
    outside = _write(tmp_path, "outside/b.txt", b"a secret out of the root")
    items = {i.document_id: i for i in scan_directory(root)}
    (root / "a.txt").unlink()
    (root / "a.txt").symlink_to(outside)
    with pytest.raises(ExtractError) as e:
        read_guarded(items["a.txt"], 100)
    assert e.value.error_class == OUTSIDE_ROOT
    os.rename(root / "sub", tmp_path / "old-sub")
    (root / "sub").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(ExtractError) as e:
        read_guarded(items["sub/b.txt"], 100)
    assert e.value.error_class == OUTSIDE_ROOT


def test_a_file_swapped_for_a_fifo_is_refused_without_blocking(tmp_path):
    _write(tmp_path, "a.txt", b"fine")
    (item,) = list(scan_directory(tmp_path))
    (tmp_path / "a.txt").unlink()
    os.mkfifo(tmp_path / "a.txt")
    outcome = []

    def read():
        try:
            read_guarded(item, 100)
        except ExtractError as exc:
            outcome.append(exc.error_class)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # unblock the reader so the test process can end
        with open(tmp_path / "a.txt", "wb"):
            pass
    assert outcome == [NOT_REGULAR]


def test_document_ids_that_could_leave_the_root_are_refused(tmp_path):
    root = tmp_path / "root"
    _write(root, "a.txt")
    _write(tmp_path, "secret.txt", b"secret")
    for bad in [
        "../secret.txt",
        "/etc/passwd",
        str(tmp_path / "secret.txt"),
        "a/../../secret.txt",
        "./a.txt",
        ".hidden",
        "sub/.git/config",
        "a//b",
        "",
        "nul\0",
    ]:
        assert document_id_problem(bad), bad
        with pytest.raises(ValueError, match="refused"):
            item_for(root, bad)
    assert document_id_problem("a.txt") is None and document_id_problem("dir one/x..y.txt") is None
    assert item_for(root, "a.txt").path == root / "a.txt"
    assert item_for(root, "missing.txt") is None


def test_item_for_resolves_links_like_the_scan(tmp_path):
    root = tmp_path / "root"
    _write(root, "real/f.txt", b"inside")
    _write(tmp_path, "outside/o.txt", b"secret")
    (root / "outdir").symlink_to(tmp_path / "outside", target_is_directory=True)
    (root / "link.txt").symlink_to(tmp_path / "outside" / "o.txt")
    os.mkfifo(root / "pipe")
    assert item_for(root, "outdir/o.txt").problem == OUTSIDE_ROOT  # through a linked directory
    assert item_for(root, "link.txt").problem == OUTSIDE_ROOT
    assert item_for(root, "real/f.txt").problem is None
    assert item_for(root, "pipe") is None and item_for(root, "real") is None


def test_undecodable_names_get_reversible_escaped_ids(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    raw_dir = os.path.join(os.fsencode(root), b"d\xe9j\xe0")
    os.mkdir(raw_dir)
    with open(os.path.join(raw_dir, b"caf\xe9 100%.md"), "wb") as f:
        f.write(b"latin-1 name")
    _write(root, "plain 100%.md")
    ids = [i.document_id for i in scan_directory(root)]
    assert ids == ["d%E9j%E0/caf%E9 100%25.md", "plain 100%.md"]
    for doc_id in ids:
        doc_id.encode("utf-8")  # storable: raises for a name that is not UTF-8
    odd = os.fsdecode(b"x\xff%41")
    assert escape_name(odd) == "x%FF%2541" and unescape_id(escape_name(odd)) == odd
    item = item_for(root, "d%E9j%E0/caf%E9 100%25.md")
    assert read_guarded(item, 100) == b"latin-1 name"
    assert item_for(root, "plain 100%.md") is not None


def test_an_escaped_name_that_collides_with_a_real_name_keeps_one_id(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    with open(os.path.join(os.fsencode(root), b"caf\xe9.md"), "wb") as f:
        f.write(b"undecodable")
    _write(root, "caf%E9.md", b"real")
    items = list(scan_directory(root))
    assert [i.document_id for i in items] == ["caf%E9.md"]
    assert read_guarded(items[0], 100) == b"real"


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
    monkeypatch.setattr(os, "open", no_open)
    with pytest.raises(ExtractError) as e:  # refused before any open (both are patched to fail)
        read_guarded(item, Settings().max_input_bytes)
    assert e.value.error_class == "too_large"
    assert "exceeds limit 20971520" in str(e.value)
    assert str(e.value).startswith("too_large: ")


@pytest.mark.parametrize("limit", [10, 4])
def test_a_file_that_grows_after_fstat_is_read_whole_or_refused(tmp_path, monkeypatch, limit):
    """read_guarded reads what fstat promised plus one byte: more means it grew, and it reads on
    (never a silently truncated text), up to the limit."""
    p = _write(tmp_path, "a.txt", b"hello")
    (item,) = list(scan_directory(tmp_path))
    real_fstat, real_stat = os.fstat, os.stat

    def shrunk(st):  # the file "grows" from 2 bytes to 5 between the size checks and the read
        return os.stat_result(
            (
                st.st_mode,
                st.st_ino,
                st.st_dev,
                st.st_nlink,
                st.st_uid,
                st.st_gid,
                2,
                st.st_atime,
                st.st_mtime,
                st.st_ctime,
            )
        )

    monkeypatch.setattr(os, "fstat", lambda fd: shrunk(real_fstat(fd)))
    monkeypatch.setattr(
        os, "stat", lambda path, *a, **k: shrunk(real_stat(path)) if Path(path) == p else real_stat(path, *a, **k)
    )
    if limit >= 5:
        assert read_guarded(item, limit) == b"hello"
    else:
        with pytest.raises(ExtractError, match="grew") as e:
            read_guarded(item, limit)
        assert e.value.error_class == "too_large"
    assert p.read_bytes() == b"hello"


def test_grown_file_detected(tmp_path, monkeypatch):
    p = _write(tmp_path, "a.txt", b"small")
    (item,) = list(scan_directory(tmp_path))
    # Simulate growth after the size check: stat reports 1 byte, file has 5.
    real_stat = os.stat

    class FakeStat:
        st_size = 1
        st_mode = stat.S_IFREG | 0o644

    monkeypatch.setattr(os, "stat", lambda path, *a, **k: FakeStat() if Path(path) == p else real_stat(path, *a, **k))
    with pytest.raises(ExtractError, match="grew") as e:
        read_guarded(item, 3)
    assert e.value.error_class == "too_large"
