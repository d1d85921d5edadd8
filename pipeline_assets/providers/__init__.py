"""Embedding providers: the OpenAI-compatible one and the offline default."""

from __future__ import annotations

import os

from pipeline_assets import settings
from .base import FATAL, RETRYABLE, TERMINAL, THROTTLED, EmbedResult, ModelSpec, Provider, ProviderError, sanitize
from .local import LOCAL_MODEL_NAME, LocalHashingProvider
from .openai_provider import OpenAIProvider

DEFAULT_OPENAI_MODEL = "text-embedding-3-small"

__all__ = [
    "FATAL", "RETRYABLE", "TERMINAL", "THROTTLED", "EmbedResult", "ModelSpec", "Provider",
    "ProviderError", "sanitize", "provider_from_env", "configured_model_name", "ConfigError",
]


class ConfigError(RuntimeError):
    """The provider is misconfigured; the message is one line and holds no key."""


def configured_model_name() -> str:
    name = os.environ.get("PIPELINE_EMBEDDING_MODEL")
    if name:
        return name
    return DEFAULT_OPENAI_MODEL if os.environ.get("OPENAI_API_KEY") else LOCAL_MODEL_NAME


def provider_from_env(model: str | None = None) -> Provider:
    """The provider for ``model`` (default: the configured one)."""
    name = model or configured_model_name()
    if name == LOCAL_MODEL_NAME:
        return LocalHashingProvider()
    if not os.environ.get("OPENAI_API_KEY"):
        raise ConfigError(f"model {name!r} needs OPENAI_API_KEY (unset it or use {LOCAL_MODEL_NAME!r} offline)")
    dims = settings.env_int("PIPELINE_EMBEDDING_DIMENSIONS", 0) or None
    batch_inputs = min(settings.env_int("PIPELINE_BATCH_INPUTS", settings.DEFAULT_BATCH_INPUTS),
                       settings.MAX_BATCH_INPUTS)
    return OpenAIProvider(
        name,
        dimensions=dims,
        timeout=settings.call_timeout(),
        max_batch_inputs=batch_inputs,
        max_batch_tokens=settings.env_int("PIPELINE_BATCH_TOKENS", settings.DEFAULT_BATCH_TOKENS),
    )
