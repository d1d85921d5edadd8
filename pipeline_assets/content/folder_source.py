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
        return walk(self.root, keep)

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
_new = tuple.__new__  # builds an Observed in half the time its constructor takes (one per file walked)


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


def walk(root: Path, keep: Callable[[str], bool] | None = None) -> Iterator[Observed]:
    """(document_id, size, mtime_ns, ref) of exactly the items ``scan_directory`` yields, in no
    particular order, at a fraction of its cost: a plain file costs one ``lstat`` and no
    ``SourceItem``. ``ref`` is None for a plain file at root/id, its path when a name on the way was
    escaped (``source_item`` builds the item if it has to be read), and for a symlink the item
    ``item_for`` classifies as the scan does. Raises SourceError as the scan does (a missing root, a
    directory that cannot be listed). A plain file ``keep`` rejects is listed unexamined: size
    NOT_STATED, no ``lstat``."""
    root = Path(root).absolute()
    if not root.is_dir():
        raise SourceError(f"source directory not found: {root}")
    # (id prefix, directory, whether its path is root/prefix: no escaped name on the way)
    stack = [("", str(root), True)]
    while stack:
        prefix, directory, plain = stack.pop()
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
                    stack.append((doc + "/", entry.path, plain and name == entry.name))
                elif entry.is_file(follow_symlinks=False):
                    ref = None if plain and name == entry.name else entry.path
                    if keep is not None and not keep(doc):
                        yield _new(Observed, (doc, NOT_STATED, 0, ref, None))
                        continue
                    st = entry.stat(follow_symlinks=False)
                    yield _new(Observed, (doc, st.st_size, st.st_mtime_ns, ref, None))
                elif entry.is_symlink():
                    item = item_for(root, doc)
                    if item is not None:
                        yield Observed(doc, item.size, item.mtime_ns, item)
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
