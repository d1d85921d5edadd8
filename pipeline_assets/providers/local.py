"""The offline default embedder: feature hashing of tokens, L2-normalised.

Deterministic, needs no download and no key, and is clearly named as what it is
(``local/hashing-cl100k-v1@256``). Token ids from the cl100k tokenizer (unigrams
and bigrams) are hashed into a fixed number of signed buckets. It captures
lexical overlap, not meaning: good for the bundled example, tests and a pipeline
dry run, not a substitute for a real model.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pipeline_assets.content.chunking import get_encoding
from .base import EmbedResult, ModelSpec

LOCAL_MODEL_NAME = "local-hashing"
LOCAL_DIMENSION = 256
# The local model has no input limit of its own; this bounds chunk size checks.
LOCAL_MAX_INPUT_TOKENS = 8191

_MULT_A = np.uint64(0x9E3779B97F4A7C15)
_MULT_B = np.uint64(0xC2B2AE3D27D4EB4F)


class LocalHashingProvider:
    def __init__(self, dimension: int = LOCAL_DIMENSION) -> None:
        self.spec = ModelSpec(
            provider="local",
            name=LOCAL_MODEL_NAME,
            id_name="hashing-cl100k-v1",
            dimension=dimension,
            max_input_tokens=LOCAL_MAX_INPUT_TOKENS,
            max_batch_inputs=2048,
            max_batch_tokens=1_000_000,
        )
        self._dim = dimension

    def embed_one(self, text: str) -> tuple[np.ndarray, int]:
        ids = np.asarray(get_encoding().encode_ordinary(text), dtype=np.uint64)
        if ids.size == 0:
            vec = np.zeros(self._dim, dtype=np.float32)
            vec[0] = 1.0
            return vec, 0
        feats = ids * _MULT_A
        if ids.size > 1:
            feats = np.concatenate([feats, (ids[:-1] * _MULT_B) ^ (ids[1:] * _MULT_A)])
        with np.errstate(over="ignore"):
            mixed = feats ^ (feats >> np.uint64(29))
        buckets = (mixed % np.uint64(self._dim)).astype(np.int64)
        signs = np.where((mixed >> np.uint64(40)) & np.uint64(1), 1.0, -1.0)
        vec = np.bincount(buckets, weights=signs, minlength=self._dim).astype(np.float32)
        norm = float(np.linalg.norm(vec))
        if norm == 0.0:
            vec[0] = 1.0
        else:
            vec /= norm
        return vec, int(ids.size)

    def embed(self, texts: Sequence[str]) -> EmbedResult:
        vectors, tokens = [], 0
        for text in texts:
            vec, n = self.embed_one(text)
            vectors.append(vec)
            tokens += n
        return EmbedResult(vectors=vectors, tokens=tokens)

    def close(self) -> None:
        pass
