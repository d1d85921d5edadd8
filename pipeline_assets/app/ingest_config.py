"""Ingest's configuration: the bounds of one document's extraction and of one ingest transaction.

Defaults are the named constants beside it; ``Settings.ingest_config()`` builds it from the
environment. A value out of range is an ``InvalidConfig`` naming the field, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_assets.component_config import check

# How bytes that are not UTF-8 are decoded: `strict` quarantines the document (`bad_encoding`),
# `replace` decodes them as U+FFFD.
DECODE_POLICIES = ("strict", "replace")
DEFAULT_DECODE_ERRORS = "strict"
# Larger files are quarantined (`too_large`) before a byte is read: bounds one extraction's memory
# and rejects stray huge files (dumps, videos).
DEFAULT_MAX_INPUT_BYTES = 20 * 1024 * 1024
# Wall-clock limit of extract + chunk per document; over it twice (each in a fresh process): `timeout`.
DEFAULT_STAGE_TIMEOUT_SECONDS = 60.0
# Address space one extraction may add (a PDF that inflates, a pathological HTML tree); 0 = none.
DEFAULT_EXTRACT_MEMORY = 2 * 1024**3
# Extraction children per ingest (0: one per CPU the process may use, its affinity mask):
# docs/decisions/0001-one-extraction-child.md.
DEFAULT_EXTRACT_PROCESSES = 0
# A small PDF can inflate to far more text than its bytes: what one document may cost in memory,
# chunk rows and provider tokens.
DEFAULT_MAX_TEXT_CHARS = 20_000_000
DEFAULT_MAX_CHUNKS_PER_DOCUMENT = 20_000
# Documents written per ingest transaction: bounds the length of the transactions that hold the
# ingest write lock.
INGEST_BATCH_DOCUMENTS = 200
# Chunk text one ingest transaction holds in memory (one larger document is a batch alone).
DEFAULT_INGEST_BATCH_BYTES = 64 * 1024 * 1024
# Attempts each enqueued embedding job gets before it is dead-lettered.
DEFAULT_MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class IngestConfig:
    max_bytes: int = DEFAULT_MAX_INPUT_BYTES
    decode_errors: str = DEFAULT_DECODE_ERRORS
    stage_timeout: float = DEFAULT_STAGE_TIMEOUT_SECONDS  # per document: extract + chunk
    extract_memory: int = DEFAULT_EXTRACT_MEMORY
    extract_processes: int = DEFAULT_EXTRACT_PROCESSES
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS  # per document
    max_chunks: int = DEFAULT_MAX_CHUNKS_PER_DOCUMENT  # per document
    batch_bytes: int = DEFAULT_INGEST_BATCH_BYTES  # chunk text per ingest transaction
    batch_documents: int = INGEST_BATCH_DOCUMENTS  # documents per ingest transaction
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # of each job enqueued

    def __post_init__(self) -> None:
        check(
            self,
            [
                (self.decode_errors in DECODE_POLICIES, "decode_errors", f"must be one of {DECODE_POLICIES}"),
                (self.max_bytes > 0, "max_bytes", "must be positive"),
                (self.extract_memory >= 0, "extract_memory", "must not be negative"),
                (self.extract_processes >= 0, "extract_processes", "must not be negative"),
                (self.max_text_chars > 0, "max_text_chars", "must be positive"),
                (self.max_chunks > 0, "max_chunks", "must be positive"),
                (self.batch_bytes > 0, "batch_bytes", "must be positive"),
                (self.batch_documents >= 1, "batch_documents", "must be at least 1"),
                (self.max_attempts >= 1, "max_attempts", "must be at least 1"),
            ],
        )
