"""Embedding providers: the OpenAI-compatible one and the offline default."""

from __future__ import annotations

from pipeline_assets.settings import Settings

from .base import (
    FATAL,
    ONNX_MODEL_NAME,
    RETRYABLE,
    TERMINAL,
    THROTTLED,
    ConfigError,
    EmbedResult,
    ModelSpec,
    Provider,
    ProviderError,
    register_secret,
    sanitize,
)
from .limits import ChunkTooLarge, ModelLimit, UnknownInputWindow, check_chunk_size, require_known_window
from .local import LOCAL_MODEL_NAME, LocalHashingProvider

__all__ = [
    "FATAL",
    "ONNX_MODEL_NAME",
    "RETRYABLE",
    "TERMINAL",
    "THROTTLED",
    "ChunkTooLarge",
    "ConfigError",
    "EmbedResult",
    "ModelLimit",
    "ModelSpec",
    "Provider",
    "ProviderError",
    "UnknownInputWindow",
    "check_chunk_size",
    "model_id_for",
    "provider_for",
    "require_known_window",
    "sanitize",
]


# The model used with a key when PIPELINE_EMBEDDING_MODEL is unset.
DEFAULT_OPENAI_MODEL = "text-embedding-3-small"


def configured_model_name(settings: Settings) -> str:
    """PIPELINE_EMBEDDING_MODEL, else the OpenAI default with a key, else the offline model."""
    if settings.embedding_model:
        return settings.embedding_model
    return DEFAULT_OPENAI_MODEL if settings.openai_api_key else LOCAL_MODEL_NAME


def provider_for(settings: Settings, model: str | None = None) -> Provider:
    """The provider for ``model`` (default: the configured one)."""
    name = model or configured_model_name(settings)
    if name == LOCAL_MODEL_NAME:
        return LocalHashingProvider()
    if name == ONNX_MODEL_NAME:
        if settings.local_model_dir is None:
            raise ConfigError(f"model {ONNX_MODEL_NAME!r} needs PIPELINE_LOCAL_MODEL_DIR (a directory with "
                              "model.onnx and tokenizer.json; nothing is downloaded)")
        from .onnx_local import OnnxProvider  # onnxruntime only when asked for

        return OnnxProvider(settings.local_model_dir, batch_inputs=settings.local_batch_inputs)
    if not settings.openai_api_key:
        raise ConfigError(f"model {name!r} needs OPENAI_API_KEY (unset it or use {LOCAL_MODEL_NAME!r} offline)")
    register_secret(settings.openai_api_key)
    from .openai_provider import OpenAIProvider  # the openai SDK (a second to import) only when asked for

    return OpenAIProvider(
        name,
        api_key=settings.openai_api_key,
        base_url=settings.openai_base_url,
        dimensions=settings.embedding_dimensions,
        timeout=settings.call_timeout,
        max_batch_inputs=settings.request_inputs,
        max_batch_tokens=settings.batch_tokens,
        max_input_tokens=settings.model_max_input_tokens,
    )


def model_id_for(settings: Settings, model: str | None = None) -> str:
    """The configured model's id (``provider/name@dimension``), for code versions.

    Never raises: a missing key is reported when a run needs the provider, not
    when the Dagster definitions load.
    """
    try:
        return provider_for(settings, model).spec.model_id
    except (ConfigError, ValueError) as exc:
        return f"unconfigured/{model or configured_model_name(settings)} ({type(exc).__name__})"
