"""One source item to chunks: read under the size guard (the source's read), checksum, then extract
and chunk in a pool of child processes killed at the wall-clock limit, under a memory
limit and the caps on text and chunks per document. No database: the caller
says what it already knows of the document and writes the result.

Every failure here is that one document's error (a ``Processed`` with an error
class), never the ingest's.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType

from pipeline_assets.component_config import ERROR_MESSAGE_MAX_CHARS
from pipeline_assets.content.chunking import Chunk, Chunker
from pipeline_assets.content.extract import ExtractError, ExtractorVersions, extract_text
from pipeline_assets.content.sandbox import Sandbox
from pipeline_assets.content.source import Item, ReadOutcome, Source

# Error class of a file that exists but cannot be read (permissions, I/O error).
UNREADABLE = "unreadable"
# Error classes of documents over the per-document caps (PIPELINE_MAX_TEXT_CHARS,
# PIPELINE_MAX_CHUNKS_PER_DOCUMENT).
TEXT_TOO_LARGE = "text_too_large"
TOO_MANY_CHUNKS = "too_many_chunks"


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
    source_token: str | None


@dataclass
class Processed:
    item: Item
    checksum: bytes | None
    text_checksum: bytes | None
    chunks: list[Chunk]
    error_class: str | None = None
    error_message: str | None = None

    def __post_init__(self) -> None:
        if self.error_message is not None:
            self.error_message = storable(self.error_message)[:ERROR_MESSAGE_MAX_CHARS]

    @property
    def text_bytes(self) -> int:
        """UTF-8 bytes of chunk text this result holds (what an ingest batch is sized by)."""
        return sum(len(c.text.encode("utf-8", "replace")) for c in self.chunks)


def storable(text: str) -> str:
    """Text PostgreSQL can store: no NUL, no lone surrogates (an undecodable file name in an
    OS error message is kept readable as backslash escapes)."""
    return text.replace("\0", "").encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class ExtractSpec:
    """What extraction needs besides the bytes; handed to the child once, at its start."""

    chunker: Chunker
    decode_errors: str
    max_text_chars: int
    max_chunks: int


def extract_and_chunk(spec: ExtractSpec, document_id: str, raw: bytes) -> tuple[bytes, list[Chunk]]:
    """Bytes to (text checksum, chunks), or ExtractError. Runs in the extraction child."""
    text = extract_text(document_id, raw, decode_errors=spec.decode_errors)
    if len(text) > spec.max_text_chars:
        raise ExtractError(
            TEXT_TOO_LARGE,
            f"extracted text of {len(text)} characters exceeds the limit of "
            f"{spec.max_text_chars} (PIPELINE_MAX_TEXT_CHARS)",
        )
    chunks = spec.chunker.chunk(text)
    if len(chunks) > spec.max_chunks:
        raise ExtractError(
            TOO_MANY_CHUNKS,
            f"{len(chunks)} chunks exceed the limit of {spec.max_chunks} "
            "per document (PIPELINE_MAX_CHUNKS_PER_DOCUMENT)",
        )
    return hashlib.sha256(text.encode("utf-8", "replace")).digest(), chunks


class Extractor:
    """``extract_and_chunk`` of one ingest's documents in up to ``processes`` extraction
    children (0: one per usable core), each document under ``timeout`` seconds and
    ``memory_limit`` bytes (0: none), pipelined (``sandbox.Sandbox``). A child starts when
    a document finds every running one busy; use as a context manager so they end with
    the ingest."""

    def __init__(self, spec: ExtractSpec, *, timeout: float, memory_limit: int, processes: int = 1) -> None:
        self.spec = spec
        self.sandbox = Sandbox(
            functools.partial(extract_and_chunk, spec), timeout=timeout, memory_limit=memory_limit, processes=processes
        )

    def __enter__(self) -> Extractor:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.sandbox.close()

    @property
    def pending(self) -> int:
        return self.sandbox.pending

    def submit(self, item: Item, checksum: bytes, raw: bytes, known: KnownDocument | None = None) -> bool:
        """Queue one document (``known``: what the database held of it, handed back by
        ``take``); False when the queue is full (``take`` first)."""
        return self.sandbox.submit((item, checksum, known), item.document_id, raw)

    def take(self) -> tuple[KnownDocument | None, Processed]:
        """The first queued document done: extracted and chunked (or quarantined)."""
        (item, checksum, known), outcome = self.sandbox.take()
        if isinstance(outcome, ExtractError):
            return known, Processed(item, checksum, None, [], outcome.error_class, outcome.message)
        text_checksum, chunks = outcome
        return known, Processed(item, checksum, text_checksum, chunks)


def unchanged_by_token(
    source: Source,
    item: Item,
    known: KnownDocument | None,
    *,
    chunker_version: str,
    extractor_version: ExtractorVersions,
) -> bool:
    """True when the source's token vouches for the bytes (``content_tokens``) and it is the
    token of the stored version, under the same code versions: the item is not read."""
    return (
        source.content_tokens
        and known is not None
        and known.status != "deleted"
        and known.source_token == item.token
        and known.extractor_version == extractor_version.of(item.document_id)
        and known.chunker_version == chunker_version
    )


def check_read(
    item: Item,
    outcome: ReadOutcome,
    known: KnownDocument | None,
    *,
    chunker_version: str,
    extractor_version: ExtractorVersions,
    force: bool = False,
    tokens: bool = False,
) -> Processed | tuple[bytes, bytes] | None:
    """Judge one item's read: None when nothing changed, a quarantine when it could not be
    read, else ``(checksum, raw)`` to extract.

    Unchanged means: same raw bytes under the same extractor and chunker
    versions, or the same quarantine (same error class and size) again; with
    ``tokens`` (the source's tokens vouch for the bytes) also the same token, so
    the token stored is always that of the bytes stored. ``force`` (a rerun)
    processes it anyway.
    """
    if isinstance(outcome, ExtractError):
        if (
            not force
            and known is not None
            and known.status == "quarantined"
            and known.error_class == outcome.error_class
            and known.size_bytes == item.size
        ):
            return None
        return Processed(item, None, None, [], outcome.error_class, outcome.message)
    if isinstance(outcome, OSError):
        return Processed(item, None, None, [], UNREADABLE, f"{type(outcome).__name__}: {outcome}")
    raw = outcome
    checksum = hashlib.sha256(raw).digest()
    if (
        not force
        and known is not None
        and known.extractor_version == extractor_version.of(item.document_id)
        and known.chunker_version == chunker_version
        and known.source_checksum == checksum
        and known.status != "deleted"
        and (not tokens or known.source_token == item.token)
    ):
        return None
    return checksum, raw


def process_items(
    source: Source,
    batches: Iterable[tuple[list[Item], Mapping[str, KnownDocument]]],
    *,
    extractor: Extractor,
    max_bytes: int,
    extractor_version: ExtractorVersions,
    force: bool = False,
) -> Iterator[tuple[Item, KnownDocument | None, Processed | None]]:
    """Every item of every batch (with what the database knew of it) and its result (None:
    unchanged), in no particular order. The source reads the items its token cannot vouch
    for (``Source.read_all``: in parallel where it pays; an item comes back as read, with the
    token of the bytes it got); reading the next ones overlaps the extraction of earlier ones
    in the children. ``batches`` is pulled lazily and the children are not drained between
    batches, so they keep working while the caller handles what was yielded."""
    chunker_version = extractor.spec.chunker.version
    for items, known in batches:
        to_read: list[Item] = []
        for item in items:
            old = known.get(item.document_id)
            if not force and unchanged_by_token(
                source, item, old, chunker_version=chunker_version, extractor_version=extractor_version
            ):
                yield item, old, None
            else:
                to_read.append(item)
        for item, outcome in source.read_all(to_read, max_bytes):
            old = known.get(item.document_id)
            step = check_read(
                item,
                outcome,
                old,
                chunker_version=chunker_version,
                extractor_version=extractor_version,
                force=force,
                tokens=source.content_tokens,
            )
            if not isinstance(step, tuple):
                yield item, old, step
                continue
            checksum, raw = step
            while not extractor.submit(item, checksum, raw, old):
                was, done = extractor.take()
                yield done.item, was, done
    while extractor.pending:
        was, done = extractor.take()
        yield done.item, was, done
