"""Directory source: enumerate the files under a root and read them safely.

``scan_directory`` streams ``SourceItem``s in a deterministic order (entries of
each directory sorted by name, depth first), so two scans of an unchanged tree
yield identical sequences. Only one directory listing per level of nesting is
held in memory, so very large trees (100k+ files) stream without a full list.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline_assets.content.extract import TOO_LARGE, ExtractError

class SourceError(Exception):
    """The source as a whole cannot be scanned (missing root, unreadable dir)."""


@dataclass(frozen=True)
class SourceItem:
    document_id: str  # path relative to the root, "/"-separated
    path: Path  # absolute path
    size: int
    mtime_ns: int
    source_uri: str  # file:// URI of the absolute path


def _sorted_entries(directory: str) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            entries = [e for e in it if not e.name.startswith(".")]
    except OSError as e:
        # Skipping silently would make every document below look deleted.
        raise SourceError(f"cannot read directory {directory}: {e}") from e
    entries.sort(key=lambda e: e.name)
    return entries


def scan_directory(root: Path) -> Iterator[SourceItem]:
    """Yield every regular file below ``root``.

    Skipped: names starting with "." (files and whole directories), symlinks to
    directories (no cycles, no escaping the tree), broken symlinks, and
    non-regular files (FIFOs, sockets, devices). A symlink to a regular file is
    yielded under its own name with the target's size and mtime.
    """
    root = Path(root).absolute()
    if not root.is_dir():
        raise SourceError(f"source directory not found: {root}")

    # Stack of (relative prefix, iterator over that directory's sorted entries).
    stack: list[tuple[str, Iterator[os.DirEntry]]] = [("", iter(_sorted_entries(str(root))))]
    while stack:
        prefix, entries = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                stack.append((f"{prefix}{entry.name}/", iter(_sorted_entries(entry.path))))
                continue
            if entry.is_symlink() and entry.is_dir():
                continue  # symlink to a directory
            st = entry.stat()  # follows symlinks to files
        except FileNotFoundError:
            continue  # vanished during the scan, or a broken symlink
        if not stat.S_ISREG(st.st_mode):
            continue
        path = Path(entry.path)
        yield SourceItem(
            document_id=prefix + entry.name,
            path=path,
            size=st.st_size,
            mtime_ns=st.st_mtime_ns,
            source_uri=path.as_uri(),
        )


def read_guarded(item: SourceItem, max_bytes: int) -> bytes:
    """Read a file, refusing anything larger than ``max_bytes``.

    The size is checked with ``os.stat`` before opening, so an oversized file
    is rejected without reading a byte. At most ``max_bytes + 1`` bytes are
    read, which also catches a file that grew after the check.
    """
    size = os.stat(item.path).st_size
    if size > max_bytes:
        raise ExtractError(TOO_LARGE, f"{item.document_id}: size {size} bytes exceeds limit {max_bytes}")
    with open(item.path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ExtractError(
            TOO_LARGE,
            f"{item.document_id}: size >{max_bytes} bytes (grew while reading) exceeds limit {max_bytes}",
        )
    return data
