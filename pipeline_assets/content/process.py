"""One source item to chunks: read under the size guard, checksum, extract and
chunk under the wall-clock limit. No database: the caller says what it already
knows of the document and writes the result.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pipeline_assets.content.chunking import Chunk, Chunker
from pipeline_assets.content.extract import ExtractError, extract_text
from pipeline_assets.content.sources import SourceItem, read_guarded
from pipeline_assets.content.timeouts import wall_clock_limit

# Error class of a file that exists but cannot be read (permissions, I/O error).
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class KnownDocument:
    """What the database holds about a document (column names of app.documents)."""

    document_id: str
    source_checksum: bytes | None
    extractor_version: str | None
    chunker_version: str | None
    status: str
    error_class: str | None
    size_bytes: int | None


@dataclass
class Processed:
    item: SourceItem
    checksum: bytes | None
    text_checksum: bytes | None
    chunks: list[Chunk]
    error_class: str | None = None
    error_message: str | None = None


def process_item(item: SourceItem, known: KnownDocument | None, *, chunker: Chunker, max_bytes: int,
                 decode_errors: str, stage_timeout: float, extractor_version: str,
                 force: bool = False) -> Processed | None:
    """Read, checksum, extract, chunk one item; None when nothing changed.

    Unchanged means: same raw bytes under the same extractor and chunker
    versions, or the same quarantine (same error class and size) again.
    ``force`` (a rerun) processes it anyway.
    """
    same_versions = (known is not None and known.extractor_version == extractor_version
                     and known.chunker_version == chunker.version)
    try:
        raw = read_guarded(item, max_bytes)
    except ExtractError as exc:
        if (not force and known is not None and known.status == "quarantined"
                and known.error_class == exc.error_class and known.size_bytes == item.size):
            return None
        return Processed(item, None, None, [], exc.error_class, exc.message)
    except OSError as exc:
        return Processed(item, None, None, [], UNREADABLE, f"{type(exc).__name__}: {exc}"[:300])
    checksum = hashlib.sha256(raw).digest()
    if not force and same_versions and known.source_checksum == checksum and known.status != "deleted":
        return None
    timeout = ExtractError("timeout", f"extract and chunk took longer than {stage_timeout:g} s")
    try:
        with wall_clock_limit(stage_timeout, timeout):
            text = extract_text(item.document_id, raw, decode_errors=decode_errors)
            chunks = chunker.chunk(text)
    except ExtractError as exc:
        return Processed(item, checksum, None, [], exc.error_class, exc.message)
    return Processed(item, checksum, hashlib.sha256(text.encode("utf-8", "replace")).digest(), chunks)
