"""The provider interface and its error classification.

A provider turns a list of texts into vectors. It never retries: one retry
policy, the job table's, owns retries. Every failure is a ProviderError whose
``kind`` tells the worker what to do with the items:

* RETRYABLE  timeouts, connection errors, 408, 409, 5xx: back off, count the attempt
* THROTTLED  429: the provider's state, not the item's; pause all workers, defer the
             items without consuming their attempts
* TERMINAL   400, 413, 422: the input is bad; split a batch to isolate it, fail it
* FATAL      401, 403, 404 (model): configuration; stop the worker, touch no item
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pipeline_assets.component_config import ERROR_MESSAGE_MAX_CHARS
from pipeline_assets.messages import one_line

if TYPE_CHECKING:  # numpy only where vectors are made
    import numpy as np

RETRYABLE = "retryable"
THROTTLED = "throttled"
TERMINAL = "terminal"
FATAL = "fatal"

# The error class (RETRYABLE) of an answer that cannot be matched to its inputs (a wrong
# count of vectors, a duplicate or missing ``index``): nothing stored, nothing charged.
BAD_RESPONSE = "bad_response"


@dataclass(frozen=True)
class ModelSpec:
    """What identifies a model and bounds its requests."""

    provider: str
    name: str
    dimension: int | None
    max_input_tokens: int
    max_batch_inputs: int
    max_batch_tokens: int
    # Options sent with every request that change the vector (e.g. dimensions).
    options: tuple[tuple[str, str], ...] = ()
    # The name inside model_id when it must say more than the configured name
    # (e.g. the local embedder's algorithm version).
    id_name: str | None = None
    # How ``max_input_tokens`` is counted: the model's own tokenizer. ``cl100k``
    # (OpenAI's models, the hashing model) is the chunker's, so a chunk's size is
    # exact; any other tokenizer is bounded by ``tokens_per_chunk_token`` of its
    # tokens per cl100k token (see ``providers.limits``).
    tokenizer: str = "cl100k"
    tokens_per_chunk_token: float = 1.0
    # Tokens the model adds to every input ([CLS] and [SEP] of a BERT model).
    special_tokens: int = 0
    # False: ``max_input_tokens`` is a guess (a server's model that is not in the provider's
    # table, with no PIPELINE_MODEL_MAX_INPUT_TOKENS); nothing is sent to such a model.
    window_known: bool = True

    @property
    def max_chunk_tokens(self) -> int:
        """The largest chunk, in the chunker's cl100k tokens, that fits the model's window."""
        return int((self.max_input_tokens - self.special_tokens) / self.tokens_per_chunk_token)

    @property
    def model_id(self) -> str:
        suffix = f"@{self.dimension}" if self.dimension else ""
        return f"{self.provider}/{self.id_name or self.name}{suffix}"


class ConfigError(RuntimeError):
    """The provider is misconfigured; the message is one line and holds no key."""


@dataclass
class EmbedResult:
    vectors: list[np.ndarray]
    tokens: int


@dataclass
class ProviderError(Exception):
    kind: str
    error_class: str
    message: str
    status: int | None = None
    retry_after: float | None = None
    billed_maybe: bool = field(default=False)  # the request may have been computed and billed

    def __post_init__(self) -> None:
        self.message = sanitize(self.message)
        super().__init__(f"{self.error_class}: {self.message}")


class Provider(Protocol):
    spec: ModelSpec

    def embed(self, texts: Sequence[str]) -> EmbedResult: ...

    def close(self) -> None: ...


_KEY_PATTERNS = [
    re.compile(r"sk-[A-Za-z0-9_\-]{6,}"),
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9_\-\.]{6,}"),
    re.compile(r"(?i)(api[_-]?key[\"'=:\s]+)[A-Za-z0-9_\-\.]{6,}"),
]


# Credentials in use by this process (registered when a provider is built):
# removed verbatim from every message, whatever their shape.
_SECRETS: set[str] = set()


def register_secret(value: str) -> None:
    if value and len(value) >= 4:
        _SECRETS.add(value)


def sanitize(message: str, limit: int = ERROR_MESSAGE_MAX_CHARS) -> str:
    """Remove anything that looks like a credential, flatten, truncate."""
    text = one_line(message)
    for secret in _SECRETS:
        text = text.replace(secret, "[redacted]")
    for pattern in _KEY_PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + "[redacted]", text)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text
