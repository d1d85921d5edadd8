"""What a model's input tokens cost, for the estimate shown before spending.

OpenAI's embedding models carry their list price (USD per million input
tokens); the offline models cost nothing; any other model's price is
PIPELINE_PRICE_PER_MILLION_TOKENS, or unknown when that is unset.
"""

from __future__ import annotations

from .base import ModelSpec

# USD per million input tokens: OpenAI's list prices of its embedding models.
OPENAI_PRICES_PER_MILLION = {
    "text-embedding-3-small": 0.02,
    "text-embedding-3-large": 0.13,
    "text-embedding-ada-002": 0.10,
}
# Providers that run on this machine: no bill.
FREE_PROVIDERS = ("local", "onnx")
# Which tokenizer the chunks' token counts match exactly (the chunker's, cl100k).
EXACT_TOKENIZER = "cl100k"


def price_per_million(spec: ModelSpec, configured: float | None) -> float | None:
    """USD per million input tokens of ``spec``'s model: built in for OpenAI's models, 0 for
    the local ones, else ``configured`` (PIPELINE_PRICE_PER_MILLION_TOKENS; None: unknown)."""
    if spec.provider in FREE_PROVIDERS:
        return 0.0
    if spec.provider == "openai" and spec.name in OPENAI_PRICES_PER_MILLION:
        return OPENAI_PRICES_PER_MILLION[spec.name]
    return configured


def tokens_exact(spec: ModelSpec) -> bool:
    """Whether the chunks' cl100k counts are the tokens the provider counts for this model (its
    usage, what the ledger records): OpenAI's models and the offline hashing model; any other
    tokenizer (a server's model, the local ONNX model) counts its own, so the figure is approximate."""
    return spec.tokenizer == EXACT_TOKENIZER
