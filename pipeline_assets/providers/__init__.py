"""Embedding providers: the OpenAI-compatible one and the offline models, built from a ``ProviderConfig``.

Importing this package loads no numerical or model library (numpy, onnxruntime, the openai SDK):
each provider's module is imported when that provider is built, so a command that builds none
does not pay for them.
"""

from __future__ import annotations

from .base import (
    FATAL,
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
from .provider_config import LOCAL_MODEL_NAME, ONNX_MODEL_NAME, ProviderConfig

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
    "ProviderConfig",
    "ProviderError",
    "UnknownInputWindow",
    "check_chunk_size",
    "model_id_for",
    "provider_for",
    "register_secret",
    "require_known_window",
    "sanitize",
]


def provider_for(config: ProviderConfig, model: str | None = None) -> Provider:
    """The provider for ``model`` (default: the configured one)."""
    name = model or config.model_name
    if name == LOCAL_MODEL_NAME:
        from .local import LocalHashingProvider  # numpy only when asked for

        return LocalHashingProvider()
    if name == ONNX_MODEL_NAME:
        if config.local_model_dir is None:
            raise ConfigError(
                f"model {ONNX_MODEL_NAME!r} needs PIPELINE_LOCAL_MODEL_DIR (a directory with "
                "model.onnx and tokenizer.json; nothing is downloaded)"
            )
        from .onnx_local import OnnxProvider  # onnxruntime only when asked for

        return OnnxProvider(config.local_model_dir, batch_inputs=config.local_batch_inputs)
    if not config.api_key:
        raise ConfigError(f"model {name!r} needs OPENAI_API_KEY (unset it or use {LOCAL_MODEL_NAME!r} offline)")
    register_secret(config.api_key)
    from .openai_provider import OpenAIProvider  # the openai SDK (a second to import) only when asked for

    return OpenAIProvider(
        name,
        api_key=config.api_key,
        base_url=config.base_url,
        dimensions=config.dimensions,
        timeout=config.call_timeout,
        max_batch_inputs=config.request_inputs,
        max_batch_tokens=config.batch_tokens,
        max_input_tokens=config.max_input_tokens,
    )


def model_id_for(config: ProviderConfig, model: str | None = None) -> str:
    """The configured model's id (``provider/name@dimension``), for code versions.

    Never raises: a missing key is reported when a run needs the provider, not
    when the Dagster definitions load.
    """
    try:
        return provider_for(config, model).spec.model_id
    except (ConfigError, ValueError) as exc:
        return f"unconfigured/{model or config.model_name} ({type(exc).__name__})"
