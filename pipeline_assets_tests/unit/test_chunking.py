import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline_assets.content import chunking
from pipeline_assets.content.chunking import (
    CHUNKER_ALGORITHM,
    DEFAULT_CHUNK_OVERLAP,
    DEFAULT_CHUNK_TOKENS,
    Chunk,
    Chunker,
    _encode,
    _learn_tokens,
    _slice_tokens,
    _starts_of,
    count_tokens,
)
from pipeline_assets.content.identity import chunk_checksum


def sample_text(n_words: int = 3000, seed: int = 7) -> str:
    rnd = random.Random(seed)
    words = [
        "alpha",
        "beta",
        "gamma",
        "délta",
        "漢字",
        "😀",
        "the",
        "of",
        "pipeline",
        "embedding",
        "idempotent",
        "x" * 25,
        "12345",
        "naïve",
        "über",
    ]
    out = []
    for _ in range(n_words):
        out.append(rnd.choice(words))
        r = rnd.random()
        out.append("\n\n" if r < 0.02 else "\n" if r < 0.05 else ". " if r < 0.1 else " ")
    return "".join(out)


def check_invariants(text: str, chunks: list[Chunk], chunker: Chunker) -> None:
    assert chunks, "non-empty text must produce chunks"
    covered_to = 0
    prev_start = -1
    for i, c in enumerate(chunks):
        assert c.index == i
        assert c.text == text[c.char_start : c.char_end]  # exact slice
        assert c.text  # never empty
        assert c.checksum == chunk_checksum(c.text)
        assert c.token_count == count_tokens(c.text) <= chunker.max_tokens
        assert c.char_start > prev_start  # strict progress
        assert c.char_start <= covered_to  # no gap: every char is covered
        covered_to = max(covered_to, c.char_end)
        prev_start = c.char_start
    assert chunks[0].char_start == 0
    assert covered_to == len(text)


def test_constants_and_version():
    c = Chunker()
    assert (c.max_tokens, c.overlap) == (DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNK_OVERLAP) == (512, 64)
    assert c.version == f"{CHUNKER_ALGORITHM}/cl100k/512/64" == "tok-window-1/cl100k/512/64"
    versions = {
        Chunker().version,
        Chunker(256, 64).version,
        Chunker(512, 32).version,
        Chunker(512, 64, hard_limit=8191).version,
    }
    assert len(versions) == 3  # hard_limit does not change output


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=7, overlap=0), "max_tokens must be >= 8"),
        (dict(max_tokens=64, overlap=64), "overlap"),
        (dict(max_tokens=64, overlap=-1), "overlap"),
        (dict(max_tokens=9000, overlap=64, hard_limit=8191), "exceeds the provider's per-input limit of 8191"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Chunker(**kwargs)


def test_hard_limit_ok():
    assert Chunker(8191, 100, hard_limit=8191).max_tokens == 8191


def test_empty_and_short():
    c = Chunker()
    assert c.chunk("") == []
    (only,) = c.chunk("hello world")
    assert (only.index, only.text, only.char_start, only.char_end) == (0, "hello world", 0, 11)
    assert only.token_count == 2


def test_determinism():
    text = sample_text()
    a, b = Chunker(64, 8).chunk(text), Chunker(64, 8).chunk(text)
    assert a == b
    assert [c.checksum for c in a] == [c.checksum for c in b]


@pytest.mark.parametrize("max_tokens, overlap", [(64, 8), (100, 0), (512, 64), (8, 7), (32, 31)])
def test_bound_and_coverage(max_tokens, overlap):
    text = sample_text()
    chunker = Chunker(max_tokens, overlap)
    check_invariants(text, chunker.chunk(text), chunker)


def test_overlap_between_consecutive_chunks():
    text = sample_text()
    chunks = Chunker(64, 16).chunk(text)
    assert len(chunks) > 10
    for a, b in itertools.pairwise(chunks):
        assert b.char_start < a.char_end  # shared text
        shared = text[b.char_start : a.char_end]
        assert 0 < count_tokens(shared) <= 16 + 2  # ~overlap tokens
    no_overlap = Chunker(64, 0).chunk(text)
    assert all(b.char_start == a.char_end for a, b in itertools.pairwise(no_overlap))


def test_prefers_whitespace_boundaries():
    text = " ".join(f"word{i}" for i in range(2000))
    chunks = Chunker(64, 8).chunk(text)
    for c in chunks[:-1]:
        assert text[c.char_end] == " "  # ended before a space, not mid-word


def test_prefers_line_breaks():
    text = "\n".join(" ".join(["line", str(i), "of", "text"] * 3) for i in range(300))
    chunks = Chunker(64, 8).chunk(text)
    for c in chunks[:-1]:
        assert c.text.endswith("\n")


@pytest.mark.parametrize(
    "text",
    [
        "a" * 100_000,  # one huge word, no whitespace
        "😀" * 20_000,  # every char spans several tokens
        "漢字仮名交じり文" * 5_000,  # CJK
        "👩‍👩‍👧‍👦🏳️‍🌈" * 3_000,  # ZWJ sequences
        "\n" * 5_000 + " " * 5_000,  # whitespace only
        "é" * 10_000,
        "ab\x00cd" * 1000,
    ],
    ids=["long-word", "emoji", "cjk", "zwj", "whitespace", "latin", "nul"],
)
def test_pathological_inputs(text):
    chunker = Chunker(32, 8)
    chunks = chunker.chunk(text)
    check_invariants(text, chunks, chunker)
    for c in chunks:
        c.text.encode("utf-8")  # valid text, no split characters


def test_special_token_text_is_ordinary():
    text = "before <|endoftext|> after"
    (c,) = Chunker().chunk(text)
    assert c.text == text


def test_lone_surrogate_does_not_break_offsets():
    text = "abc\ud800def " * 50
    chunker = Chunker(16, 4)
    chunks = chunker.chunk(text)
    clean = text.replace("\ud800", "\ufffd")
    check_invariants(clean, chunks, chunker)


def test_one_megabyte_speed():
    text = sample_text(n_words=120_000, seed=3)
    while len(text) < 1_000_000:
        text += text
    text = text[:1_000_000]
    chunker = Chunker()
    t = time.monotonic()
    chunks = chunker.chunk(text)
    elapsed = time.monotonic() - t
    # A guard against quadratic behaviour (minutes on 1 MB), not a benchmark: ~0.5 s on a quiet
    # machine, so the bound holds on a loaded one too.
    assert elapsed < 30.0, elapsed
    check_invariants(text, chunks, chunker)


# Characters around which cl100k's pieces are decided: ASCII and other letters, digits, contractions,
# spaces, tabs, line ends, symbols, multi-byte characters.
_TRICKY = [
    "a",
    "Z",
    "é",
    "漢",
    "😀",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\n\n",
    "'s",
    "'ll",
    "'T",
    "1",
    "123456",
    ".",
    "!?",
    "-",
    "_",
]


@settings(max_examples=400, deadline=None)
@given(
    parts=st.lists(st.sampled_from([*_TRICKY, "word", "The", "x" * 30]), min_size=1, max_size=80),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), min_size=2, max_size=2),
)
def test_a_slice_reuses_the_whole_texts_tokens_exactly(parts, cuts):
    """The tokens a slice is given from the whole text's (between its sync points) are the
    tokens of the slice encoded on its own, wherever the slice starts and ends."""
    text = "".join(parts)
    tokens = _encode(text)
    _learn_tokens(tokens)
    cum = list(itertools.accumulate(map(_starts_of.__getitem__, tokens), initial=0))
    start, end = sorted(c % (len(text) + 1) for c in cuts)
    if start == end:
        return
    assert _slice_tokens(text, tokens, cum, start, end) == _encode(text[start:end])


def test_chunks_of_prose_reuse_the_whole_texts_tokens(monkeypatch):
    """Long lines of words: each chunk's tokens come from the whole text's, only a word or two at
    each end is encoded again; the chunks are those of encoding every slice on its own (the
    invariants)."""
    text = "# Title\n\n" + " ".join(f"word{i % 97} alpha beta" for i in range(3000))
    chunker = Chunker(128, 16)
    reference = chunker.chunk(text)
    encoded: list[int] = []
    real = chunking._encode

    def counting(piece: str) -> list[int]:
        encoded.append(len(piece))
        return real(piece)

    check_invariants(text, reference, chunker)
    monkeypatch.setattr(chunking, "_encode", counting)
    assert chunker.chunk(text) == reference
    assert len(reference) > 20 and sum(encoded) < len(text) // 10  # ~ two words per chunk, not the text again
