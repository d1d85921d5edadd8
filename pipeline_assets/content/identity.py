"""Deterministic identities: every key is derived from content or code, never random."""

from __future__ import annotations

import hashlib


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_checksum(raw: bytes) -> str:
    """sha256 of the raw bytes of a source item."""
    return sha256_hex(raw)


def chunk_checksum(text: str) -> str:
    """sha256 of the exact text sent to the provider (UTF-8)."""
    return sha256_hex(text.encode("utf-8"))


def model_id(provider: str, name: str, dimension: int | None) -> str:
    """The provider model plus every option that changes the vector.

    ``openai/text-embedding-3-small@1536``; a different dimension is a different model.
    """
    return f"{provider}/{name}@{dimension if dimension else 'auto'}"
