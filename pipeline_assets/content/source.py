"""The source interface: where documents come from (a folder, an object store, a table).

A ``Source`` lists items with a change token, reads one item's bytes and looks up given ids; every
use (ingest, observations, bucket runs, reconciliation, ``status``) goes through it. Contracts:

* ids carry their source (``s3://bucket/key``, ``table:schema.name/123``, a folder's relative path);
* a failed listing raises ``SourceError``, never yields an empty one; a completed listing is complete;
* ``read`` refuses an item over ``max_bytes`` from its listed size before reading a byte;
* one unreadable item: ``ExtractError`` or ``OSError``; the whole source failing: ``SourceError``;
* where ``content_tokens`` is true an equal token guarantees equal bytes (never read again);
* messages never contain credentials.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

from pipeline_assets.content.extract import ExtractError

# Hex digits of an observation's checksum (a sha256 prefix): enough to tell versions of one document apart.
CHECKSUM_HEX = 16


class SourceError(Exception):
    """The source as a whole cannot be listed or read (missing root, unreachable endpoint,
    credentials refused): nothing is tombstoned on its account. One line, no secrets."""


class Item(Protocol):
    """One listed item (a file, an object, a row)."""

    @property
    def document_id(self) -> str: ...  # carries its source; the bucket is its hash
    @property
    def size(self) -> int: ...  # bytes as listed: the size guard applies to it before any read
    @property
    def mtime_ns(self) -> int: ...  # modification time as listed (0: none); the sensor's prefilter
    @property
    def token(self) -> str: ...  # the change token (see ``Source.content_tokens``)
    @property
    def source_uri(self) -> str: ...  # where it is, stored with the document (no credentials)
    @property
    def problem(self) -> str | None: ...  # an error class the listing found: quarantined, never read


# Observed.size of an item listed but not examined (``observe``'s keep rejected it).
NOT_STATED = -1


class Observed(NamedTuple):
    """One entry of ``Source.observe``: what the sensor's prefilter compares. ``checksum``:
    the fingerprint when the listing alone gives it (a content token), else None and the
    sensor asks ``Source.fingerprint`` for the entries its prefilter cannot vouch for;
    ``ref``: a handle the source needs to find the item again (None: its id is enough)."""

    document_id: str
    size: int
    mtime_ns: int
    ref: object = None
    checksum: str | None = None


# What ``Source.read_all`` yields per item: its bytes, or the item's own error.
ReadOutcome = bytes | ExtractError | OSError


class Source(Protocol):
    """A place documents come from. See the module docstring for the contracts."""

    key: str  # stable identity: app.sources.root and app.source_observations.root
    kind: str  # app.sources.kind: 'directory', 's3', 'table'
    content_tokens: bool  # an equal token guarantees equal bytes (no read needed)

    def describe(self) -> str:
        """One line naming the source for people (status, asset metadata); no credentials."""

    def check(self) -> None:
        """Return when the source can be listed now; else SourceError (a cheap probe)."""

    def items(self) -> Iterator[Item]:
        """Every item, complete, or SourceError. Streamed (pages), bounded memory."""

    def observe(self, keep: Callable[[str], bool] | None = None) -> Iterator[Observed]:
        """Every item as the sensor's prefilter needs it (may be cheaper than ``items``);
        complete, or SourceError. In no particular order. An item ``keep`` rejects may be
        yielded unexamined, with size NOT_STATED (a folder does not stat it)."""

    def fingerprint(self, observed: Observed, max_bytes: int) -> str | None:
        """CHECKSUM_HEX hex digits telling this version of the item from others (a hash of
        the bytes, or of a content token without reading); None: unreadable right now."""

    def id_problem(self, document_id: str) -> str | None:
        """Why ``document_id`` cannot name an item of this source (None if it can): ids from
        people or Dagster partition keys are checked before any lookup."""

    def lookup(self, document_ids: Sequence[str]) -> dict[str, Item]:
        """The items that exist now among ``document_ids`` (each passing ``id_problem``); an id
        absent from the answer is gone. SourceError if the source cannot be asked."""

    def read(self, item: Item, max_bytes: int) -> bytes:
        """One item's bytes under the guards (ExtractError, OSError, SourceError: see above)."""

    def read_all(self, items: Iterable[Item], max_bytes: int) -> Iterator[tuple[Item, ReadOutcome]]:
        """``read`` of each item (some in parallel, a bounded number at a time), in their order.
        The item yielded with bytes is the version read (same id; its token and size those of
        the bytes, which may be newer than the listing's). A SourceError is raised, not yielded."""


def read_in_order(source: Source, items: Iterable[Item], max_bytes: int) -> Iterator[tuple[Item, ReadOutcome]]:
    """``read_all`` one item at a time (for sources where a read costs no round trip)."""
    for item in items:
        try:
            yield item, source.read(item, max_bytes)
        except (ExtractError, OSError) as exc:
            yield item, exc


def token_checksum(token: str) -> str:
    """The observation checksum of a content token (an ETag, a row version): no read needed."""
    return hashlib.sha256(token.encode()).hexdigest()[:CHECKSUM_HEX]
