"""OpenAI-compatible provider through the official ``openai`` SDK.

The SDK's own retries are off (max_retries=0): the job table's policy is the
only one. Each request has a hard wall-clock deadline (``ProviderConfig.call_timeout``
over the whole call, not per read: ``providers.deadline``); a call past it is
an ordinary retryable ``timeout`` whose inputs may have been billed. The key and
base URL come from the ``ProviderConfig`` (OPENAI_API_KEY, OPENAI_BASE_URL).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the SDK (a second to import) is imported when the first request is sent
    import openai

from . import deadline
from .base import BAD_RESPONSE, FATAL, RETRYABLE, TERMINAL, THROTTLED, EmbedResult, ModelSpec, ProviderError
from .limits import FOREIGN_SPECIAL_TOKENS, FOREIGN_TOKENS_PER_CHUNK_TOKEN

# Known dimensions and per-input token limits (cl100k tokens, the chunker's);
# other models are discovered from the first response (the dimension is then
# recorded with the model), their window is PIPELINE_MODEL_MAX_INPUT_TOKENS:
# without it, nothing is sent to them (``limits.require_known_window``).
KNOWN_MODELS = {
    "text-embedding-3-small": (1536, 8191),
    "text-embedding-3-large": (3072, 8191),
    "text-embedding-ada-002": (1536, 8191),
}
DEFAULT_MAX_INPUT_TOKENS = 8191
# What the window of a model is counted in when it is not one of OpenAI's.
SERVER_TOKENIZER = "model"


def parse_retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Retry-After in seconds (numeric form), or OpenAI's retry-after-ms."""
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw:
            try:
                return max(0.0, float(raw) * scale)
            except ValueError:
                continue
    return None


def classify(exc: Exception) -> ProviderError:
    """Map an SDK exception to our four kinds."""
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return ProviderError(RETRYABLE, "timeout", "provider call timed out (wall-clock deadline)", billed_maybe=True)
    if isinstance(exc, openai.APIConnectionError):
        return ProviderError(RETRYABLE, "connection", f"connection error: {exc}", billed_maybe=True)
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        message = _error_message(exc)
        retry_after = parse_retry_after(exc.response.headers if exc.response is not None else None)
        if status == 429:
            if _error_code(exc) == "insufficient_quota":
                # Out of credit is not a rate limit: waiting will not fix it.
                return ProviderError(FATAL, "insufficient_quota", message, status)
            return ProviderError(THROTTLED, "rate_limited", message, status, retry_after)
        if status in (401, 403):
            return ProviderError(FATAL, "auth", message, status)
        if status == 404:
            return ProviderError(FATAL, "model_not_found", message, status)
        if status in (400, 413, 422):
            return ProviderError(TERMINAL, "bad_input", message, status)
        if status in (408, 409) or status >= 500:
            return ProviderError(RETRYABLE, f"http_{status}", message, status, retry_after)
        # Any other 4xx (402, 405, 410, 415, ...) says the request is wrong, not
        # an input: stop rather than dead-letter the corpus.
        return ProviderError(FATAL, f"http_{status}", message, status)
    return ProviderError(RETRYABLE, "provider_error", f"{type(exc).__name__}: {exc}")


def parse_answer(body: bytes, inputs: int) -> EmbedResult:
    """The vectors of an embeddings answer, in input order (each is the one carrying its
    ``index``: base64 float32 or a list of floats, as OpenAI-compatible servers send).

    An answer that cannot be matched to its ``inputs`` (not JSON, no data, a wrong count,
    a duplicate or missing index, an undecodable vector) is a RETRYABLE BAD_RESPONSE:
    the provider's fault; the worker stores nothing and charges nothing for it."""
    try:
        answer = json.loads(body)
        data = sorted(((d["index"], d["embedding"]) for d in answer["data"]), key=lambda d: d[0])
        if len(data) != inputs:
            raise ProviderError(RETRYABLE, BAD_RESPONSE, f"expected {inputs} vectors, got {len(data)}")
        # The right count is not enough: each input's vector is the one carrying its index, so
        # the indexes must be exactly 0..n-1 (a duplicate or a missing one: whose is which?).
        if any(index != i for i, (index, _) in enumerate(data)):
            raise ProviderError(
                RETRYABLE,
                BAD_RESPONSE,
                f"expected {inputs} vectors indexed 0..{inputs - 1}, got indexes "
                f"{_indexes(index for index, _ in data)}",
            )
        vectors = [_vector(embedding) for _, embedding in data]
        usage = answer.get("usage") or {}
        tokens = int(usage.get("total_tokens") or 0)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # binascii.Error is a ValueError
        raise ProviderError(
            RETRYABLE, BAD_RESPONSE, f"unusable answer for {inputs} inputs: {type(exc).__name__}: {exc}"
        ) from None
    return EmbedResult(vectors=vectors, tokens=tokens)


def _vector(embedding: str | list[float]) -> np.ndarray:
    if isinstance(embedding, str):  # base64 of little-endian float32
        return np.frombuffer(base64.b64decode(embedding, validate=True), dtype="<f4")
    if not isinstance(embedding, list):
        raise TypeError(f"an embedding is base64 or a list of floats, not {type(embedding).__name__}")
    return np.asarray(embedding, dtype=np.float32)


def _indexes(indexes: Iterable[int], shown: int = 8) -> str:
    """The answer's indexes (sorted) for the error message, the first ``shown`` of them."""
    got = list(indexes)
    return ",".join(map(str, got[:shown])) + (f",... ({len(got)})" if len(got) > shown else "")


def _error_code(exc: openai.APIStatusError) -> str | None:
    body = exc.body
    inner = body.get("error", body) if isinstance(body, dict) else None
    return inner.get("code") if isinstance(inner, dict) else None


def _error_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return f"HTTP {exc.status_code}: {inner['message']}"
    return f"HTTP {exc.status_code}: {exc.message}"


class OpenAIProvider:
    def __init__(
        self,
        name: str,
        *,
        api_key: str,
        base_url: str | None,
        dimensions: int | None,
        timeout: float,
        max_batch_inputs: int,
        max_batch_tokens: int,
        max_input_tokens: int | None = None,
    ) -> None:
        known = name in KNOWN_MODELS
        known_dim, max_tokens = KNOWN_MODELS.get(name, (None, DEFAULT_MAX_INPUT_TOKENS))
        # Known: OpenAI's own model, counted in cl100k. Otherwise the server's model has
        # a tokenizer of its own; its window (when given) is bounded in chunk tokens.
        foreign = not known and max_input_tokens is not None
        self.window_known = known or max_input_tokens is not None
        options: tuple[tuple[str, str], ...] = ()
        if dimensions:
            options = (("dimensions", str(dimensions)),)
        self.spec = ModelSpec(
            provider="openai",
            name=name,
            dimension=dimensions or known_dim,
            max_input_tokens=max_input_tokens or max_tokens,
            max_batch_inputs=max_batch_inputs,
            max_batch_tokens=max_batch_tokens,
            options=options,
            tokenizer=SERVER_TOKENIZER if foreign else "cl100k",
            tokens_per_chunk_token=FOREIGN_TOKENS_PER_CHUNK_TOKEN if foreign else 1.0,
            special_tokens=FOREIGN_SPECIAL_TOKENS if foreign else 0,
            window_known=self.window_known,
        )
        self._dimensions = dimensions
        self._timeout = timeout
        self._connection = (api_key, base_url)
        self._client: openai.OpenAI | None = None
        self._client_lock = threading.Lock()

    def _sdk(self) -> openai.OpenAI:
        """The SDK client, made on the first request (a command that sends none never imports it)."""
        if self._client is not None:  # every later request: no lock
            return self._client
        with self._client_lock:
            if self._client is None:
                import openai

                api_key, base_url = self._connection
                # Explicit key and base URL (from Settings); the SDK reads no environment of its own here.
                http_client = deadline.install(openai.DefaultHttpxClient(timeout=self._timeout))
                self._client = openai.OpenAI(
                    api_key=api_key, base_url=base_url, max_retries=0, timeout=self._timeout, http_client=http_client
                )
            return self._client

    def embed(self, texts: Sequence[str]) -> EmbedResult:
        import openai

        client = self._sdk()
        # Only when set (typed Any: the SDK's "not given" sentinel differs between its versions).
        options: dict[str, Any] = {"dimensions": self._dimensions} if self._dimensions else {}
        try:
            with deadline.within(self._timeout):  # the whole call, however the answer trickles in
                # The raw answer (the SDK's public with_raw_response), base64 as the SDK itself asks
                # for: parsed here straight into float32 arrays, not into one pydantic object and one
                # Python float per dimension that would be turned back into an array.
                raw = client.embeddings.with_raw_response.create(
                    model=self.spec.name, input=list(texts), encoding_format="base64", **options
                )
                body = raw.content
        except openai.OpenAIError as exc:
            raise classify(exc) from None
        return parse_answer(body, len(texts))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
