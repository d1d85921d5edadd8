"""The ingest's variables: the guards on each document, the chunk size, the extractor versions
(``ingest_config()``; the chunking is ``app.runtime``'s, fitted to the configured model)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_assets.app.ingest_config import (
    DEFAULT_DECODE_ERRORS,
    DEFAULT_EXTRACT_MEMORY,
    DEFAULT_EXTRACT_PROCESSES,
    DEFAULT_INGEST_BATCH_BYTES,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_CHUNKS_PER_DOCUMENT,
    DEFAULT_MAX_INPUT_BYTES,
    DEFAULT_MAX_TEXT_CHARS,
    DEFAULT_STAGE_TIMEOUT_SECONDS,
    IngestConfig,
)
from pipeline_assets.settings.reading import setting


@dataclass(frozen=True)
class ContentSettings:
    max_attempts: int = setting("PIPELINE_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS, "attempts before a job is dead-lettered")
    max_input_bytes: int = setting(
        "PIPELINE_MAX_INPUT_BYTES",
        DEFAULT_MAX_INPUT_BYTES,
        "larger files are quarantined (`too_large`) without being read",
        shown_default="20 MiB",
    )
    stage_timeout: float = setting(
        "PIPELINE_STAGE_TIMEOUT",
        DEFAULT_STAGE_TIMEOUT_SECONDS,
        "wall-clock limit of extract + chunk per document (s); over it twice (each in a fresh process): `timeout`",
    )
    extract_memory: int = setting(
        "PIPELINE_EXTRACT_MEMORY",
        DEFAULT_EXTRACT_MEMORY,
        "address space one extraction may add, in bytes; over it: `memory_limit`; 0 = none",
        shown_default="2 GiB",
    )
    extract_processes: int = setting(
        "PIPELINE_EXTRACT_PROCESSES",
        DEFAULT_EXTRACT_PROCESSES,
        "extraction child processes per ingest at most; 0 = one per usable core",
    )
    max_text_chars: int = setting(
        "PIPELINE_MAX_TEXT_CHARS",
        DEFAULT_MAX_TEXT_CHARS,
        "extracted characters per document; over it: `text_too_large`",
    )
    max_chunks_per_document: int = setting(
        "PIPELINE_MAX_CHUNKS_PER_DOCUMENT",
        DEFAULT_MAX_CHUNKS_PER_DOCUMENT,
        "chunks per document; over it: `too_many_chunks`",
    )
    ingest_batch_bytes: int = setting(
        "PIPELINE_INGEST_BATCH_BYTES",
        DEFAULT_INGEST_BATCH_BYTES,
        "chunk text per ingest transaction, in bytes",
        shown_default="64 MiB",
    )
    decode_errors: str = setting(
        "PIPELINE_DECODE_ERRORS",
        DEFAULT_DECODE_ERRORS,
        "`replace` decodes bad UTF-8 with U+FFFD instead of quarantining (`bad_encoding`)",
    )
    # Unset: content.chunking's defaults fitted to the configured model's window (``app.runtime.chunking``).
    chunk_tokens: int | None = setting(
        "PIPELINE_CHUNK_TOKENS",
        None,
        "chunk size in cl100k tokens; a size past a model's window is refused",
        shown_default="`512`, or the largest the configured model's window takes (169 for `local-onnx`)",
    )
    chunk_overlap: int | None = setting(
        "PIPELINE_CHUNK_OVERLAP",
        None,
        "tokens shared by consecutive chunks",
        shown_default="`64`; an eighth of a default chunk size under 512",
    )
    extractor_version: str | None = setting(
        "PIPELINE_EXTRACTOR_VERSION",
        None,
        "overrides the extractor versions (a dry run of a parser fix): `V` for "
        "every format, `pdf=V[,html=W]` for those formats only (text, html, pdf)",
        shown_default="`EXTRACTOR_VERSION` in `content/extract.py`",
    )

    def ingest_config(self) -> IngestConfig:
        return IngestConfig(
            max_bytes=self.max_input_bytes,
            decode_errors=self.decode_errors,
            stage_timeout=self.stage_timeout,
            extract_memory=self.extract_memory,
            extract_processes=self.extract_processes,
            max_text_chars=self.max_text_chars,
            max_chunks=self.max_chunks_per_document,
            batch_bytes=self.ingest_batch_bytes,
            max_attempts=self.max_attempts,
        )
