"""The local folder as a ``Source`` (content/source.py): the directory scan and guarded
read of ``content/sources.py``, and the sensor's fast walk.

Ids are paths relative to the root (as they always were: nothing ingested before is
re-embedded); the key is the resolved absolute root. The token (size and mtime) is a
prefilter only, so ``content_tokens`` is false: ingest reads and checksums a file to
tell whether it changed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from pipeline_assets.content.source import (
    CHECKSUM_HEX,
    NOT_STATED,
    Item,
    Observed,
    ReadOutcome,
    Source,
    SourceError,
    read_in_order,
)
from pipeline_assets.content.sources import (
    SourceItem,
    document_id_problem,
    escape_name,
    item_for,
    read_guarded,
    scan_directory,
)

READ_BLOCK = 1 << 20  # bytes per read while hashing a file


class FolderSource:
    """The files under a directory: one file, one document."""

    kind = "directory"
    content_tokens = False

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.key = str(self.root)

    def __repr__(self) -> str:
        return f"FolderSource({self.key!r})"

    def describe(self) -> str:
        return f"folder {self.key}"

    def check(self) -> None:
        if not self.root.is_dir():
            raise SourceError(f"source directory {self.root} not found")

    def items(self) -> Iterator[SourceItem]:
        return scan_directory(self.root)

    def observe(self, keep: Callable[[str], bool] | None = None) -> Iterator[Observed]:
        base = os.path.join(self.key, "")
        for doc, size, mtime_ns, found in walk(self.root, keep):
            # A plain file at root/id needs no handle; a symlink or an escaped name keeps its own.
            yield Observed(doc, size, mtime_ns, None if found == base + doc else found)

    def fingerprint(self, observed: Observed, max_bytes: int) -> str | None:
        doc, size, mtime_ns, ref, _ = observed
        if isinstance(ref, SourceItem):
            return file_checksum(ref, max_bytes)
        path = str(ref) if ref is not None else os.path.join(self.key, doc)
        return file_checksum(source_item(self.root, doc, path, size, mtime_ns), max_bytes)

    def id_problem(self, document_id: str) -> str | None:
        return document_id_problem(document_id)

    def lookup(self, document_ids: Sequence[str]) -> dict[str, Item]:
        self.check()
        found: dict[str, Item] = {}
        for doc in document_ids:
            item = item_for(self.root, doc)
            if item is not None:
                found[doc] = item
        return found

    def read(self, item: Item, max_bytes: int) -> bytes:
        assert isinstance(item, SourceItem), item
        return read_guarded(item, max_bytes)

    def read_all(self, items: Iterable[Item], max_bytes: int) -> Iterator[tuple[Item, ReadOutcome]]:
        return read_in_order(self, items, max_bytes)


def as_source(source: Source | Path) -> Source:
    """A source as is; a path is the folder at that path."""
    return FolderSource(source) if isinstance(source, Path) else source


# -- the sensor's walk ----------------------------------------------------------------------
def file_checksum(item: SourceItem, max_bytes: int) -> str | None:
    """sha256 prefix of the bytes, or of size+mtime for files the core will not read; None if unreadable."""
    h = hashlib.sha256()
    if item.problem:
        # Out of the source root: quarantined without being read; never read here either.
        h.update(f"{item.problem}:{item.size}:{item.mtime_ns}".encode())
    elif item.size > max_bytes:
        # Quarantined as too large without being read; do not read it here either.
        h.update(f"oversize:{item.size}:{item.mtime_ns}".encode())
    else:
        try:
            with open(item.path, "rb") as f:
                for block in iter(lambda: f.read(READ_BLOCK), b""):
                    h.update(block)
        except OSError:
            return None
    return h.hexdigest()[:CHECKSUM_HEX]


def walk(root: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, int, int, str | SourceItem]]:
    """(document_id, size, mtime_ns, path or item) of exactly the items ``scan_directory``
    yields, in no particular order, at a fraction of its cost: a plain file costs one
    ``lstat`` and no ``SourceItem`` (its path is given: ``source_item`` builds the item if it
    has to be read); a symlink is classified by ``item_for`` as the scan classifies it.
    Raises SourceError as the scan does (a missing root, a directory that cannot be listed).
    A plain file ``keep`` rejects is listed unexamined: size NOT_STATED, no ``lstat``."""
    root = Path(root).absolute()
    if not root.is_dir():
        raise SourceError(f"source directory not found: {root}")
    stack = [("", str(root))]
    while stack:
        prefix, directory = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = [e for e in it if not e.name.startswith(".")]
        except OSError as e:
            raise SourceError(f"cannot read directory {directory}: {e}") from e
        names = [e.name if e.name.isascii() else escape_name(e.name) for e in entries]
        if len(set(names)) < len(names):
            # As the scan does: a real name keeps its id; an undecodable one escaping to it is skipped.
            real = {e.name for e in entries}
            kept = [(e, n) for e, n in zip(entries, names) if n == e.name or n not in real]
        else:
            kept = list(zip(entries, names))
        for entry, name in kept:
            doc = prefix + name
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append((doc + "/", entry.path))
                elif entry.is_file(follow_symlinks=False):
                    if keep is not None and not keep(doc):
                        yield doc, NOT_STATED, 0, entry.path
                        continue
                    st = entry.stat(follow_symlinks=False)
                    yield doc, st.st_size, st.st_mtime_ns, entry.path
                elif entry.is_symlink():
                    item = item_for(root, doc)
                    if item is not None:
                        yield doc, item.size, item.mtime_ns, item
            except (OSError, ValueError):
                continue  # vanished during the walk, a broken link or a loop (the scan skips those too)


def source_item(root: Path, document_id: str, path: str, size: int, mtime_ns: int) -> SourceItem:
    """The item of a plain file ``walk`` listed (under the root: reached through real directories)."""
    p = Path(path)
    return SourceItem(
        document_id=document_id,
        path=p,
        size=size,
        mtime_ns=mtime_ns,
        source_uri=p.as_uri(),
        root=os.path.realpath(root),
    )
