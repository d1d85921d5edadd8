"""An S3-compatible object store prefix as a ``Source`` (content/source.py): ``s3://BUCKET/PREFIX``.

The client is obstore, configured by the standard AWS environment and ``SourceConfig.s3_endpoint``;
credentials are never read, printed or logged here. Ids are ``s3://bucket/key``; the token is the
ETag and size (``content_tokens``: an equal token is never downloaded again); the prefix is a
folder and folder markers are skipped. Listing goes in pages (``S3_PAGE_KEYS``), reads at most
``S3_READS_IN_FLIGHT`` at a time, the size guard applied before any download; a read returns the
object with the token of the bytes it got. Transient failures are retried (``S3_ATTEMPTS`` in all,
a listing resuming after its last key); then, or at once for 401/403, a missing bucket or a bad
request: ``SourceError``, one line naming the status and S3 error code only (docs/sources.md).
"""

from __future__ import annotations

import datetime
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import obstore
from obstore.exceptions import BaseError, NotFoundError
from obstore.store import S3Store

from pipeline_assets.content.extract import TOO_LARGE, ExtractError
from pipeline_assets.content.source import Item, Observed, ReadOutcome, SourceError, token_checksum

T = TypeVar("T")

S3_PAGE_KEYS = 1000  # keys per list request (the S3 maximum)
S3_READS_IN_FLIGHT = 8  # objects downloaded (or looked up) at once
S3_ATTEMPTS = 4  # attempts of one request before the source is judged unreachable
S3_CONNECT_TIMEOUT = datetime.timedelta(seconds=10)
S3_REQUEST_TIMEOUT = datetime.timedelta(seconds=120)

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z0-9.]+)</Code>")
_TRANSIENT = {408, 429, 500, 502, 503, 504}
# What obstore raises for a missing object (its own class, or Python's).
_MISSING = (NotFoundError, FileNotFoundError)


@dataclass(frozen=True)
class ObjectItem:
    document_id: str  # s3://bucket/key
    key: str
    size: int
    mtime_ns: int
    etag: str
    problem: str | None = None

    @property
    def token(self) -> str:
        return f"{self.etag}:{self.size}"

    @property
    def source_uri(self) -> str:
        return self.document_id


@dataclass(frozen=True)
class S3Failure:
    """What went wrong with one request, without the error's text (it may name the request)."""

    status: int | None  # HTTP status; None: no answer (refused, reset, timed out)
    code: str | None  # S3 error code (NoSuchBucket, InvalidAccessKeyId, SlowDown, ...)

    @property
    def transient(self) -> bool:
        return self.status is None or self.status in _TRANSIENT

    def __str__(self) -> str:
        if self.status is None:
            return "no answer (connection refused, reset or timed out)"
        return f"HTTP {self.status}" + (f" {self.code}" if self.code else "")


def failure_of(exc: BaseException) -> S3Failure:
    text = str(exc)
    status = _STATUS.search(text)
    code = _CODE.search(text)
    return S3Failure(int(status.group(1)) if status else None, code.group(1) if code else None)


def parse_spec(spec: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://BUCKET[/PREFIX]``; the prefix without its slashes at either end."""
    if not spec.startswith("s3://"):
        raise SourceError(f"not an S3 source: {spec!r} (expected s3://BUCKET/PREFIX)")
    bucket, _, prefix = spec[len("s3://") :].partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise SourceError(f"not a valid S3 bucket name in {spec!r}")
    return bucket, prefix.strip("/")


class S3Source:
    """The objects under a prefix of a bucket: one object, one document."""

    kind = "s3"
    content_tokens = True

    def __init__(
        self,
        bucket: str,
        prefix: str,
        store: Any,
        *,
        endpoint: str | None,
        pause: Callable[[int], float],
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``pause(attempt)``: the seconds to wait before attempt ``attempt + 1`` of a request."""
        self.bucket, self.prefix, self.store, self.endpoint = bucket, prefix, store, endpoint
        self.key = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._ids = f"s3://{bucket}/"
        self._pause = pause
        self._sleep = sleep

    @classmethod
    def open(cls, spec: str, *, endpoint: str | None, pause: Callable[[int], float]) -> S3Source:
        """The source ``spec`` names; credentials and region come from the AWS environment."""
        bucket, prefix = parse_spec(spec)
        config: dict[str, Any] = {}
        if endpoint:
            config["endpoint"] = endpoint
        client = {
            "connect_timeout": S3_CONNECT_TIMEOUT,
            "timeout": S3_REQUEST_TIMEOUT,
            "allow_http": bool(endpoint and endpoint.startswith("http://")),
        }
        try:
            store = S3Store(
                bucket,
                config=config,  # type: ignore[arg-type]
                client_options=client,  # type: ignore[arg-type]
                retry_config={"max_retries": 0, "retry_timeout": S3_REQUEST_TIMEOUT},
            )
        except BaseError as exc:
            raise SourceError(f"cannot configure S3 for {spec}: {type(exc).__name__}") from None
        return cls(bucket, prefix, store, endpoint=endpoint, pause=pause)

    def __repr__(self) -> str:
        return f"S3Source({self.key!r})"

    def describe(self) -> str:
        return f"{self.key} at {self.endpoint or 'AWS S3'}"

    # -- requests ----------------------------------------------------------------------------
    def _retrying(self, what: str, request: Callable[[], T]) -> T:
        for attempt in range(1, S3_ATTEMPTS + 1):
            try:
                return request()
            except _MISSING:
                raise
            except BaseError as exc:
                self._judge(what, exc, attempt)
        raise AssertionError("unreachable")

    def _judge(self, what: str, exc: BaseException, attempt: int) -> None:
        """Return after the pause before another attempt; else SourceError (one line, no secrets)."""
        failure = failure_of(exc)
        if not failure.transient:
            raise SourceError(f"{self.describe()}: {what} refused: {failure}") from None
        if attempt >= S3_ATTEMPTS:
            raise SourceError(f"{self.describe()}: {what} failed {attempt} times: {failure}") from None
        self._sleep(self._pause(attempt))

    def _pages(self) -> Iterator[Sequence[Any]]:
        """The listing, page by page; a page that fails is retried, resuming after the last key."""
        offset: str | None = None
        attempt = 0
        while True:
            try:
                stream = obstore.list(self.store, self.prefix or None, offset=offset, chunk_size=S3_PAGE_KEYS)
                for page in stream:
                    attempt = 0
                    if page:
                        yield page
                        offset = page[-1]["path"]
                return
            except BaseError as exc:
                attempt += 1
                self._judge("listing", exc, attempt)

    def _item(self, meta: Any) -> ObjectItem:
        key = meta["path"]
        modified = meta.get("last_modified")
        mtime_ns = int(modified.timestamp() * 1e9) if modified is not None else 0
        return ObjectItem(self._ids + key, key, int(meta["size"]), mtime_ns, str(meta.get("e_tag") or ""))

    # -- the interface -----------------------------------------------------------------------
    def check(self) -> None:
        self._retrying("listing", lambda: next(iter(obstore.list(self.store, self.prefix or None, chunk_size=1)), None))

    def items(self) -> Iterator[ObjectItem]:
        for page in self._pages():
            for meta in page:
                if not meta["path"].endswith("/"):
                    yield self._item(meta)

    def observe(self, keep: Callable[[str], bool] | None = None) -> Iterator[Observed]:
        for item in self.items():
            yield Observed(item.document_id, item.size, item.mtime_ns, None, token_checksum(item.token))

    def fingerprint(self, observed: Observed, max_bytes: int) -> str | None:
        try:
            found = self.lookup([observed.document_id]).get(observed.document_id)
        except SourceError:
            return None
        return token_checksum(found.token) if found is not None else None

    def id_problem(self, document_id: str) -> str | None:
        if not document_id.startswith(self._ids):
            return f"not an object of bucket {self.bucket} (ids are {self._ids}KEY)"
        key = document_id[len(self._ids) :]
        if not key or key.endswith("/") or "\0" in key:
            return "not an object key"
        if self.prefix and not key.startswith(self.prefix + "/"):
            return f"not under the prefix {self.prefix}/"
        return None

    def lookup(self, document_ids: Sequence[str]) -> dict[str, Item]:
        keys = [d[len(self._ids) :] for d in document_ids]

        def head(key: str) -> ObjectItem | None:
            try:
                return self._item(dict(self._retrying("lookup", lambda: obstore.head(self.store, key))))
            except _MISSING:
                return None

        return {item.document_id: item for item in self._bounded(head, keys) if item is not None}

    def read(self, item: Item, max_bytes: int) -> bytes:
        return self._get(item, max_bytes)[1]

    def _get(self, item: Item, max_bytes: int) -> tuple[ObjectItem, bytes]:
        assert isinstance(item, ObjectItem), item
        if item.size > max_bytes:  # from the listing: not a byte downloaded
            raise ExtractError(TOO_LARGE, f"{item.document_id}: size {item.size} bytes exceeds limit {max_bytes}")

        def get() -> tuple[dict, bytes]:
            result = obstore.get(self.store, item.key)
            return dict(result.meta), bytes(result.bytes())

        try:
            meta, data = self._retrying("read", get)
        except _MISSING:
            raise FileNotFoundError(f"{item.document_id}: deleted since it was listed") from None
        got = self._item(meta)
        if len(data) > max_bytes:
            raise ExtractError(
                TOO_LARGE,
                f"{item.document_id}: size {len(data)} bytes (replaced since it was listed) exceeds limit {max_bytes}",
            )
        return replace(got, size=len(data)), data

    def read_all(self, items: Iterable[Item], max_bytes: int) -> Iterator[tuple[Item, ReadOutcome]]:
        def one(item: Item) -> tuple[Item, ReadOutcome]:
            try:
                return self._get(item, max_bytes)
            except (ExtractError, OSError) as exc:
                return item, exc

        yield from self._bounded(one, items)

    def _bounded(self, fn: Callable[[Any], T], args: Iterable[Any]) -> Iterator[T]:
        """``fn`` of each arg, at most S3_READS_IN_FLIGHT at once, in order (SourceError raised)."""
        with ThreadPoolExecutor(S3_READS_IN_FLIGHT, thread_name_prefix="s3-read") as pool:
            window: deque[Future[T]] = deque()
            try:
                for arg in args:
                    window.append(pool.submit(fn, arg))
                    if len(window) >= S3_READS_IN_FLIGHT:
                        yield window.popleft().result()
                while window:
                    yield window.popleft().result()
            finally:
                for future in window:
                    future.cancel()
