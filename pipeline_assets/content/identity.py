"""Deterministic identities: every key is derived from content or code, never random."""

from __future__ import annotations

import hashlib


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chunk_checksum(text: str) -> str:
    """sha256 of the exact text sent to the provider (UTF-8)."""
    return sha256_hex(text.encode("utf-8"))
