"""The offline default embedder: signed feature hashing of words, L2-normalised.

Deterministic, needs no download and no key, named as what it is (``local/hashing-words-v2@512``):
words without English stop words and with a few suffix rules, bigrams at half weight, character
trigrams at a low weight, each weighted ``1 + log tf`` and hashed (blake2b) to one of ``dimension``
buckets with a sign from the same hash. Lexical, not semantic (docs/models.md, the offline model).

Any change to its output must change ``LOCAL_MODEL_VERSION``: the version is part of the model
id, so vectors of two versions are never mixed.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from hashlib import blake2b

import numpy as np

from pipeline_assets.content.chunking import get_encoding

from .base import EmbedResult, ModelSpec
from .provider_config import LOCAL_MODEL_NAME

# Part of the model id: bump it whenever the embedder's output changes.
LOCAL_MODEL_VERSION = "hashing-words-v2"
# Buckets of the hashed vector; more buckets, fewer collisions (and 4 bytes each per stored vector).
LOCAL_DIMENSION = 512
# The local model has no input limit of its own; this bounds chunk size checks.
LOCAL_MAX_INPUT_TOKENS = 8191

# Relative weight of a word bigram and of a word's character trigrams (all of
# them together) against the word itself.
BIGRAM_WEIGHT = 0.5
TRIGRAM_WEIGHT = 0.35
# Words shorter than this get no character trigrams (they are their own trigram).
TRIGRAM_MIN_WORD = 5
# Distinct words and features cached (stems, trigrams, bucket and sign; three bounded LRUs).
# Bounds this model's memory (a corpus of mostly unique words fills any larger bound:
# docs/benchmarks.md#figures-behind-constants); frequent words fit, and a miss costs one blake2b.
FEATURE_CACHE_SIZE = 16_384

_WORD = re.compile(r"[^\W_]+")

# English function words: they say how a sentence is built, not what it is about.
STOP_WORDS = frozenset(
    """
a about above after again against all am an and any are aren't as at be because been before being below
between both but by can cannot could did do does doing down during each few for from further had has have
having he her here hers herself him himself his how i if in into is it its itself just let me more most my
myself no nor not now of off on once only or other our ours ourselves out over own same she should so some
such than that the their theirs them themselves then there these they this those through to too under until
up very was we were what when where which while who whom why will with would you your yours yourself
yourselves s t d ll m re ve also may might must shall us get got gets much many one ones every
""".split()
)

# Inflectional suffixes, longest first: (suffix, replacement, shortest stem kept).
_SUFFIXES = (
    ("ments", "", 4),
    ("ment", "", 4),
    ("ness", "", 3),
    ("ings", "", 3),
    ("ing", "", 3),
    ("edly", "", 3),
    ("ies", "y", 2),
    ("ied", "y", 2),
    ("ed", "", 3),
    ("ly", "", 4),
    ("s", "", 3),
)


@lru_cache(maxsize=FEATURE_CACHE_SIZE)
def stem(word: str) -> str:
    """A few English suffix rules: not Porter's stemmer, only enough to join plurals and tenses
    (``retry``, ``retries``, ``retrying`` -> ``retri``; ``queue``, ``queues`` -> ``queu``)."""
    for suffix, replacement, shortest in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= shortest and not word.endswith("ss"):
            word = word[: len(word) - len(suffix)] + replacement
            if (
                replacement == ""
                and suffix != "s"
                and len(word) > 3
                and word[-1] == word[-2]
                and word[-1] not in "aeiouls"
            ):
                word = word[:-1]  # stopp(ed) -> stop, runn(ing) -> run
            break
    if len(word) > 3 and word[-1] == "e":
        word = word[:-1]
    elif len(word) > 3 and word[-1] == "y":
        word = word[:-1] + "i"
    return word


def terms(text: str) -> list[str]:
    """The kept words of ``text``, stemmed, in order."""
    return [stem(w) for w in _WORD.findall(text.lower()) if w not in STOP_WORDS and len(w) > 1]


def features(text: str) -> dict[str, float]:
    """Feature -> weight before hashing: sublinear word and bigram counts, trigrams spread per word."""
    words = terms(text)
    counts: Counter[str] = Counter(words)
    weights: dict[str, float] = {}
    for word, tf in counts.items():
        weights[word] = 1.0 + math.log(tf)
    for pair, tf in Counter(f"{a} {b}" for a, b in itertools.pairwise(words)).items():
        weights[pair] = BIGRAM_WEIGHT * (1.0 + math.log(tf))
    for word in counts:
        grams = _trigrams(word)
        if grams:
            share = TRIGRAM_WEIGHT * weights[word] / len(grams)
            for gram in grams:
                weights[gram] = weights.get(gram, 0.0) + share
    return weights


@lru_cache(maxsize=FEATURE_CACHE_SIZE)
def _trigrams(word: str) -> tuple[str, ...]:
    """The character trigrams of a kept word, as features (``#`` keeps them apart from words)."""
    if len(word) < TRIGRAM_MIN_WORD:
        return ()
    padded = f"<{word}>"
    return tuple("#" + padded[i : i + 3] for i in range(len(padded) - 2))


@lru_cache(maxsize=FEATURE_CACHE_SIZE)
def _bucket(feature: str, dim: int) -> tuple[int, float]:
    h = int.from_bytes(blake2b(feature.encode("utf-8"), digest_size=8).digest(), "little")
    return (h >> 1) % dim, (1.0 if h & 1 else -1.0)


class LocalHashingProvider:
    def __init__(self, dimension: int = LOCAL_DIMENSION) -> None:
        self.spec = ModelSpec(
            provider="local",
            name=LOCAL_MODEL_NAME,
            id_name=LOCAL_MODEL_VERSION,
            dimension=dimension,
            max_input_tokens=LOCAL_MAX_INPUT_TOKENS,
            max_batch_inputs=2048,
            max_batch_tokens=1_000_000,
        )
        self._dim = dimension

    def embed_one(self, text: str) -> tuple[np.ndarray, int]:
        """The text's vector, and its cl100k token count (what usage and budgets count)."""
        weighted = features(text)
        hashed = [_bucket(feature, self._dim) for feature in weighted]
        buckets = np.fromiter((b for b, _ in hashed), dtype=np.int64, count=len(hashed))
        signed = np.fromiter(
            (s * w for (_, s), w in zip(hashed, weighted.values())), dtype=np.float64, count=len(hashed)
        )
        vec: np.ndarray = np.bincount(buckets, weights=signed, minlength=self._dim)
        norm = float(np.linalg.norm(vec))
        if norm == 0.0:
            vec[0] = 1.0  # nothing but stop words: a fixed unit vector, never a zero one
        else:
            vec = vec / norm
        return vec.astype(np.float32), len(get_encoding().encode_ordinary(text))

    def embed(self, texts: Sequence[str]) -> EmbedResult:
        vectors, tokens = [], 0
        for text in texts:
            vec, n = self.embed_one(text)
            vectors.append(vec)
            tokens += n
        return EmbedResult(vectors=vectors, tokens=tokens)

    def close(self) -> None:
        pass
