"""Per-model input windows: a chunk is never longer than a model takes, nothing is truncated.

The chunker counts cl100k tokens; a model's window is in its own tokens
(``ModelSpec.max_input_tokens``). The largest chunk a model takes is its window for a cl100k
model, else ``(window - special tokens) / FOREIGN_TOKENS_PER_CHUNK_TOKEN``.
``require_known_window`` refuses a model with no known window (set
PIPELINE_MODEL_MAX_INPUT_TOKENS) and ``check_chunk_size`` a PIPELINE_CHUNK_TOKENS past a model's
bound, each in one line, at `models add` and at worker start, before anything is sent
(docs/models.md, input windows).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .base import ConfigError, ModelSpec

# Model tokens per cl100k token assumed for a tokenizer other than cl100k: above the largest ratio
# WordPiece showed on the bundled corpus, so every prose chunk stays inside the window
# (docs/benchmarks.md#figures-behind-constants).
FOREIGN_TOKENS_PER_CHUNK_TOKEN = 1.5
# Tokens a server's model (not OpenAI's) is assumed to add to each input: BERT's
# [CLS] and [SEP], XLM-R's <s> and </s>.
FOREIGN_SPECIAL_TOKENS = 2
CHUNK_TOKENS_SETTING = "PIPELINE_CHUNK_TOKENS"
WINDOW_SETTING = "PIPELINE_MODEL_MAX_INPUT_TOKENS"


@dataclass(frozen=True)
class ModelLimit:
    """A model's window (its own tokens) and the largest chunk (cl100k tokens) that fits it."""

    model_id: str
    max_input_tokens: int
    max_chunk_tokens: int
    tokenizer: str = "cl100k"

    @classmethod
    def of(cls, spec: ModelSpec) -> ModelLimit:
        return cls(spec.model_id, spec.max_input_tokens, spec.max_chunk_tokens, spec.tokenizer)

    def describe(self) -> str:
        if self.tokenizer == "cl100k":
            return f"window {self.max_input_tokens} tokens (cl100k)"
        return (
            f"window {self.max_input_tokens} {self.tokenizer} tokens, chunks of at most "
            f"{self.max_chunk_tokens} cl100k tokens"
        )


class ChunkTooLarge(ConfigError, ValueError):
    """PIPELINE_CHUNK_TOKENS could exceed a model's input window."""

    def __init__(self, chunk_tokens: int, limit: ModelLimit) -> None:
        self.chunk_tokens = chunk_tokens
        self.limit = limit
        if limit.tokenizer == "cl100k":
            why = f"its input window is {limit.max_input_tokens} tokens"
        else:
            why = (
                f"its input window is {limit.max_input_tokens} {limit.tokenizer} tokens, "
                f"which fits at most {limit.max_chunk_tokens} cl100k tokens"
            )
        super().__init__(
            f"{CHUNK_TOKENS_SETTING}={chunk_tokens} is too large for model {limit.model_id}: "
            f"{why}; set {CHUNK_TOKENS_SETTING}={limit.max_chunk_tokens} or less "
            "(inputs are never truncated)"
        )


class UnknownInputWindow(ConfigError, ValueError):
    """A server's model whose input window nobody gave: refused before anything is sent to it."""

    def __init__(self, spec: ModelSpec) -> None:
        self.model_id = spec.model_id
        super().__init__(
            f"the input window of model {spec.model_id} is unknown (not one of the provider's "
            f"models); set {WINDOW_SETTING} to it, in the model's own tokens (512 for e5-small "
            "or bge-small), so that no chunk is truncated by the server"
        )


def require_known_window(spec: ModelSpec) -> None:
    """Raise ``UnknownInputWindow`` (one line naming the setting) for a model whose window is a guess."""
    if not spec.window_known:
        raise UnknownInputWindow(spec)


def too_small(chunk_tokens: int, limits: Iterable[ModelLimit]) -> list[ModelLimit]:
    """The models whose window a chunk of ``chunk_tokens`` could exceed, smallest first."""
    return sorted((m for m in limits if chunk_tokens > m.max_chunk_tokens), key=lambda m: m.max_chunk_tokens)


def check_chunk_size(chunk_tokens: int, limits: Iterable[ModelLimit]) -> None:
    """Raise ``ChunkTooLarge`` (one line) for the smallest window the chunk size does not fit."""
    over = too_small(chunk_tokens, limits)
    if over:
        raise ChunkTooLarge(chunk_tokens, over[0])
