"""The provider's variables: which model, its server and key, how its requests are bounded
(``provider_config()``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline_assets.jobqueue.executor_config import DEFAULT_CALL_TIMEOUT_SECONDS
from pipeline_assets.providers.provider_config import (
    DEFAULT_BATCH_INPUTS,
    DEFAULT_BATCH_TOKENS,
    DEFAULT_LOCAL_BATCH_INPUTS,
    MAX_BATCH_INPUTS,
    ProviderConfig,
)
from pipeline_assets.settings.reading import setting


@dataclass(frozen=True)
class ProviderSettings:
    openai_api_key: str | None = setting(
        "OPENAI_API_KEY",
        None,
        "key for the OpenAI-compatible provider; never printed, logged or stored",
        secret=True,
        shown_default="unset: the offline model",
    )
    openai_base_url: str | None = setting(
        "OPENAI_BASE_URL", None, "any OpenAI-compatible server", shown_default="the SDK's default"
    )
    embedding_model: str | None = setting(
        "PIPELINE_EMBEDDING_MODEL",
        None,
        "the active model",
        shown_default="`text-embedding-3-small` with a key, else `local-hashing`",
    )
    embedding_dimensions: int | None = setting(
        "PIPELINE_EMBEDDING_DIMENSIONS",
        None,
        "sent as `dimensions`; part of the model id",
        shown_default="model default",
    )
    call_timeout: float = setting(
        "PIPELINE_CALL_TIMEOUT",
        DEFAULT_CALL_TIMEOUT_SECONDS,
        "wall-clock limit of one provider request, however its answer trickles in (s)",
    )
    batch_inputs: int = setting(
        "PIPELINE_BATCH_INPUTS", DEFAULT_BATCH_INPUTS, f"inputs per provider request (≤ {MAX_BATCH_INPUTS})"
    )
    batch_tokens: int = setting("PIPELINE_BATCH_TOKENS", DEFAULT_BATCH_TOKENS, "tokens per provider request")
    # A server's model window cannot be asked over the OpenAI API; known OpenAI
    # models carry theirs (8191). Without it a chunk past the window would be
    # silently truncated by servers such as TEI or infinity, so a model outside
    # the provider's table is refused until it is set.
    model_max_input_tokens: int | None = setting(
        "PIPELINE_MODEL_MAX_INPUT_TOKENS",
        None,
        "input window of the OpenAI-compatible server's model, in its own tokens; chunks are checked against it",
        shown_default="OpenAI's models: 8191; others: none, and `models add`, `work`, `embed` and Dagster "
        "refuse the model until it is set",
    )
    price_per_million_tokens: float | None = setting(
        "PIPELINE_PRICE_PER_MILLION_TOKENS",
        None,
        "USD per million input tokens of a model without a built-in price, for the dry runs' cost estimate",
        shown_default="OpenAI's models: built in; local models: free",
    )
    local_model_dir: Path | None = setting(
        "PIPELINE_LOCAL_MODEL_DIR",
        None,
        "directory of the `local-onnx` model (`model.onnx`, `tokenizer.json`, the model card's configs); read offline",
        shown_default="unset: `local-onnx` is refused",
    )
    local_batch_inputs: int = setting(
        "PIPELINE_LOCAL_BATCH_INPUTS", DEFAULT_LOCAL_BATCH_INPUTS, "inputs per call of the local ONNX model"
    )

    def provider_config(self) -> ProviderConfig:
        return ProviderConfig(
            model=self.embedding_model,
            api_key=self.openai_api_key,
            base_url=self.openai_base_url,
            dimensions=self.embedding_dimensions,
            call_timeout=self.call_timeout,
            batch_inputs=self.batch_inputs,
            batch_tokens=self.batch_tokens,
            max_input_tokens=self.model_max_input_tokens,
            local_model_dir=self.local_model_dir,
            local_batch_inputs=self.local_batch_inputs,
        )
