"""The provider's configuration: which model, where its server is, how its requests are bounded.

Defaults are the named constants beside it; ``Settings.provider_config()`` builds it from the
environment and ``providers.provider_for`` builds the provider from it. A value out of range is an
``InvalidConfig`` naming the field, in one line. The key is a secret: never in its repr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline_assets.component_config import check
from pipeline_assets.jobqueue.executor_config import DEFAULT_CALL_TIMEOUT_SECONDS

# PIPELINE_EMBEDDING_MODEL of the offline hashing model (``providers.local``, the default without a
# key) and of the local ONNX model (``providers.onnx_local``, an optional extra).
LOCAL_MODEL_NAME = "local-hashing"
ONNX_MODEL_NAME = "local-onnx"
# The model used with a key when PIPELINE_EMBEDDING_MODEL is unset.
DEFAULT_OPENAI_MODEL = "text-embedding-3-small"
# Inputs per provider request allowed by the OpenAI API: a larger batch_inputs is sent in requests of this many.
MAX_BATCH_INPUTS = 2048
# Inputs and tokens per request to the OpenAI-compatible provider.
DEFAULT_BATCH_INPUTS = 256
DEFAULT_BATCH_TOKENS = 100_000
# Inputs per call of the local ONNX model, run shortest first in inference batches of 16
# (``providers.onnx_local``): 32 keeps padding low; larger calls gain little on 2 cores and hold
# their jobs longer.
DEFAULT_LOCAL_BATCH_INPUTS = 32


@dataclass(frozen=True)
class ProviderConfig:
    model: str | None = None  # None: DEFAULT_OPENAI_MODEL with a key, else LOCAL_MODEL_NAME
    api_key: str | None = field(default=None, repr=False)
    base_url: str | None = None  # any OpenAI-compatible server; None: the SDK's default
    dimensions: int | None = None  # sent as `dimensions`; part of the model id
    call_timeout: float = DEFAULT_CALL_TIMEOUT_SECONDS  # wall-clock limit of one request
    batch_inputs: int = DEFAULT_BATCH_INPUTS
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    max_input_tokens: int | None = None  # a server's model window, in its tokens; None: OpenAI's or unknown
    local_model_dir: Path | None = None  # the `local-onnx` model's files; None: that model is refused
    local_batch_inputs: int = DEFAULT_LOCAL_BATCH_INPUTS

    def __post_init__(self) -> None:
        check(
            self,
            [
                (self.call_timeout > 0, "call_timeout", "must be positive"),
                (self.batch_inputs >= 1, "batch_inputs", "must be at least 1"),
                (self.batch_tokens >= 1, "batch_tokens", "must be at least 1"),
                (self.dimensions is None or self.dimensions > 0, "dimensions", "must be positive"),
                (self.max_input_tokens is None or self.max_input_tokens > 0, "max_input_tokens", "must be positive"),
                (self.local_batch_inputs >= 1, "local_batch_inputs", "must be at least 1"),
            ],
        )

    @property
    def model_name(self) -> str:
        """The configured model: ``model``, else the OpenAI default with a key, else the offline model."""
        if self.model:
            return self.model
        return DEFAULT_OPENAI_MODEL if self.api_key else LOCAL_MODEL_NAME

    @property
    def request_inputs(self) -> int:
        """Inputs per request to the OpenAI-compatible provider: ``batch_inputs``, at most the API's."""
        return min(self.batch_inputs, MAX_BATCH_INPUTS)
