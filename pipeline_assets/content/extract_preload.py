"""Imported once by the extraction server before it forks any child (``server_process.PRELOAD_MODULES``):
the tokenizer with its table loaded, the parsers and the extraction code, so every child starts
with them and no document's deadline pays for an import."""

from __future__ import annotations

import contextlib

from pipeline_assets.content import process  # noqa: F401  (extract_and_chunk and what it imports)
from pipeline_assets.content.chunking import get_encoding

get_encoding()
for _module in ("bs4", "pypdf"):
    with contextlib.suppress(ImportError):
        __import__(_module)
