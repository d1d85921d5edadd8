"""Directory source: enumerate the files under a root and read them safely.

``scan_directory`` streams ``SourceItem``s in a deterministic order (sorted by name, depth first),
holding one directory listing per level. Only regular files whose real path is under the root are
read: a symlink out of it is listed as ``outside_root`` and never opened, and ``read_guarded``
checks the file it actually opened (a name swapped after the scan is refused too).

Document ids are ``/``-separated paths relative to the root; a name that is not valid UTF-8 gets a
reversible id (each undecodable byte ``%XX``, ``%`` itself ``%25``, only in such names).
``item_for`` maps an id back to its file; ``document_id_problem`` refuses ids no scan produces
(absolute, ``..``, hidden components), whoever supplies them.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline_assets.content.extract import TOO_LARGE, ExtractError
from pipeline_assets.content.source import SourceError

__all__ = [
    "NOT_REGULAR",
    "OUTSIDE_ROOT",
    "SourceError",
    "SourceItem",
    "document_id_problem",
    "escape_name",
    "item_for",
    "read_guarded",
    "scan_directory",
    "unescape_id",
]

# Error classes of items that are listed but never read.
OUTSIDE_ROOT = "outside_root"  # its real path is not under the source root (a symlink out of it)
NOT_REGULAR = "not_regular_file"  # became a FIFO, socket, device or directory after the scan

# Undecodable bytes of a file name, as os.fsdecode represents them (surrogateescape).
_ESCAPED_BYTES = re.compile("[\udc80-\udcff%]")
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # what os.fsdecode makes of bytes that are not UTF-8
_ESCAPE = re.compile("%(25|[89A-F][0-9A-F])")
# Opened without blocking (a FIFO would block open() forever), never as a terminal.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class SourceItem:
    document_id: str  # path relative to the root, "/"-separated, escaped if not UTF-8
    path: Path  # absolute path (as listed: may be a symlink)
    size: int
    mtime_ns: int
    source_uri: str  # file:// URI of the absolute path
    root: str  # real path of the source root: reads are confined under it
    problem: str | None = None  # error class found by the scan (outside_root): quarantined, never read

    @property
    def token(self) -> str:
        """The change token: size and mtime (a prefilter: a rewrite may keep both)."""
        return f"{self.size}.{self.mtime_ns}"


# -- ids ------------------------------------------------------------------------------------
def escape_name(name: str) -> str:
    """A file name fit to store: unchanged if valid UTF-8, else undecodable bytes as %XX and % as %25."""
    if name.isascii() or not _UNDECODABLE.search(name):
        return name
    return _ESCAPED_BYTES.sub(lambda m: "%25" if m.group() == "%" else f"%{ord(m.group()) - 0xDC00:02X}", name)


def unescape_id(document_id: str) -> str:
    """The inverse of ``escape_name`` (per component): %XX back to the undecodable byte."""
    return _ESCAPE.sub(lambda m: "%" if m.group(1) == "25" else chr(0xDC00 + int(m.group(1), 16)), document_id)


def document_id_problem(document_id: str) -> str | None:
    """Why ``document_id`` cannot name a file of a source (None if it can). Refused: what no
    scan produces and what could leave the root: absolute paths, '.' and '..', hidden
    components, empty components, NUL, text that is not UTF-8."""
    if not document_id:
        return "empty document id"
    if document_id.startswith("/") or os.path.isabs(document_id):
        return "absolute path"
    if "\0" in document_id:
        return "contains NUL"
    if any("\ud800" <= ch <= "\udfff" for ch in document_id):
        return "not valid UTF-8"
    for part in document_id.split("/"):
        if part in (".", ".."):
            return f"contains a {part!r} component"
        if not part:
            return "contains an empty component"
        if part.startswith("."):
            return "contains a hidden component (never scanned)"
    return None


# -- scanning -------------------------------------------------------------------------------
def _under(path: str, real_root: str) -> bool:
    return path == real_root or path.startswith(real_root.rstrip(os.sep) + os.sep)


def _sorted_entries(directory: str) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            entries = [e for e in it if not e.name.startswith(".")]
    except OSError as e:
        # Skipping silently would make every document below look deleted.
        raise SourceError(f"cannot read directory {directory}: {e}") from e
    entries.sort(key=lambda e: e.name)
    names = [escape_name(e.name) for e in entries]
    if len(set(names)) < len(names):
        # An undecodable name whose escaped form is also a real name here: the real
        # name keeps the id (one id, one file); the undecodable one is skipped.
        real = {e.name for e in entries}
        entries = [e for e, n in zip(entries, names) if n == e.name or n not in real]
    return entries


def _classify(path: str, document_id: str, real_root: str, *, listed: bool) -> SourceItem | None:
    """The item ``path`` is, or None when it is not a document (a directory, a broken
    link, a non-regular file, gone). A link out of the root is an item with a problem.
    ``listed``: the scan reached ``path`` through real directories (never through a
    link), so a plain file is under the root without resolving it."""
    st = os.lstat(path)
    if listed and stat.S_ISREG(st.st_mode):
        inside = True
    elif listed and not stat.S_ISLNK(st.st_mode):
        return None  # a FIFO, socket or device
    else:
        real = os.path.realpath(path)
        target = os.stat(real)  # metadata only, also for a target outside the root
        if not stat.S_ISREG(target.st_mode):
            return None  # directories (linked ones are never followed), FIFOs, sockets, devices
        inside = _under(real, real_root)
        if inside:
            st = target  # a link inside the root reads as its target
    p = Path(path)
    return SourceItem(
        document_id=document_id,
        path=p,
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        source_uri=p.as_uri(),
        root=real_root,
        problem=None if inside else OUTSIDE_ROOT,
    )


def scan_directory(root: Path) -> Iterator[SourceItem]:
    """Yield every regular file below ``root``.

    Skipped: names starting with "." (files and whole directories), symlinks to
    directories (no cycles, no escaping the tree), broken symlinks, and
    non-regular files (FIFOs, sockets, devices). A symlink to a regular file
    under the root is yielded under its own name with the target's size and
    mtime; one to a file outside the root is yielded with ``problem =
    outside_root`` and the link's own size and mtime, and is never read.
    """
    root = Path(root).absolute()
    if not root.is_dir():
        raise SourceError(f"source directory not found: {root}")
    real_root = os.path.realpath(root)

    # Stack of (relative prefix, iterator over that directory's sorted entries).
    stack: list[tuple[str, Iterator[os.DirEntry]]] = [("", iter(_sorted_entries(str(root))))]
    while stack:
        prefix, entries = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            continue
        name = escape_name(entry.name)
        try:
            if entry.is_dir(follow_symlinks=False):
                stack.append((f"{prefix}{name}/", iter(_sorted_entries(entry.path))))
                continue
            item = _classify(entry.path, prefix + name, real_root, listed=True)
        except OSError:
            continue  # vanished during the scan, a broken symlink or a link loop
        if item is not None:
            yield item


def _locate(root: str, document_id: str) -> str | None:
    """The path an id names: per component the name as is, else its unescaped form."""
    path = root
    for part in document_id.split("/"):
        for name in dict.fromkeys((part, unescape_id(part))):
            if os.path.lexists(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
        else:
            return None
    return path


def item_for(root: Path, document_id: str) -> SourceItem | None:
    """The item a document id names under ``root`` (classified like the scan, its real path
    resolved), or None if there is no such document now. Raises ValueError for an id
    ``document_id_problem`` refuses."""
    problem = document_id_problem(document_id)
    if problem:
        raise ValueError(f"document id {document_id!r} refused: {problem}")
    base = str(Path(root).absolute())
    path = _locate(base, document_id)
    if path is None:
        return None
    try:
        return _classify(path, document_id, os.path.realpath(base), listed=False)
    except OSError:
        return None


# -- reading --------------------------------------------------------------------------------
def _opened_path(fd: int, path: Path) -> str | None:
    """The real path of the file open as ``fd``: the kernel's name for it where /proc
    exists, else the resolved path if it is still the same file (device and inode)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        real = os.path.realpath(path)
        opened, resolved = os.fstat(fd), os.stat(real)
        same = (opened.st_dev, opened.st_ino) == (resolved.st_dev, resolved.st_ino)
        return real if same else None


def read_guarded(item: SourceItem, max_bytes: int) -> bytes:
    """Read a file, refusing anything larger than ``max_bytes`` and anything that is
    not a regular file under the source root.

    The size is checked with ``os.stat`` before opening, so an oversized file
    is rejected without reading a byte. The file is opened without blocking and
    checked as opened (regular, under the root, size). At most ``max_bytes + 1``
    bytes are read, which also catches a file that grew after the check.
    """
    if item.problem:
        raise ExtractError(item.problem, f"{item.document_id}: resolves outside the source root; not read")
    st = os.stat(item.path)
    if not stat.S_ISREG(st.st_mode):  # before opening: opening a device can have effects
        raise ExtractError(NOT_REGULAR, f"{item.document_id}: not a regular file; not read")
    size = st.st_size
    if size > max_bytes:
        raise ExtractError(TOO_LARGE, f"{item.document_id}: size {size} bytes exceeds limit {max_bytes}")
    fd = os.open(item.path, _OPEN_FLAGS)
    with open(fd, "rb", closefd=True) as f:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise ExtractError(NOT_REGULAR, f"{item.document_id}: not a regular file; not read")
        real = _opened_path(fd, item.path)
        if real is None or not _under(real, item.root):
            raise ExtractError(OUTSIDE_ROOT, f"{item.document_id}: resolves outside the source root; not read")
        if opened.st_size > max_bytes:
            raise ExtractError(
                TOO_LARGE,
                f"{item.document_id}: size {opened.st_size} bytes (grew while reading) exceeds limit {max_bytes}",
            )
        os.set_blocking(fd, True)
        # Read what fstat promised and one byte more, not max_bytes + 1 at once: a read that
        # size allocates its whole buffer first (max_bytes, for every small file). One
        # byte more than promised means the file grew meanwhile: read on, up to the limit.
        want = min(opened.st_size, max_bytes) + 1
        data = f.read(want)
        if len(data) == want and want <= max_bytes:
            data += f.read(max_bytes + 1 - want)
    if len(data) > max_bytes:
        raise ExtractError(
            TOO_LARGE,
            f"{item.document_id}: size >{max_bytes} bytes (grew while reading) exceeds limit {max_bytes}",
        )
    return data
