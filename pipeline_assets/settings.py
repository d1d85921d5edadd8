"""Every setting in one place: one typed, immutable ``Settings``, built once.

``Settings.from_env()`` reads the environment exactly once (at the edge: the command line, the
Dagster definitions or a resource) and the object is passed down; nothing below reads ``os.environ``.
Each field names its environment variable, its default and what it bounds; docs/configuration.md is
generated from them (``python -m pipeline_assets.settings_reference``, checked by a test). Each
component gets its own config built here (``worker_config()``, ``ingest_config()``, ...), with its
defaults named beside it; constants not meant to be tuned per deployment live with their component.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

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
from pipeline_assets.app.source_config import SourceConfig
from pipeline_assets.component_config import InvalidConfig
from pipeline_assets.defs.dagster_config import (
    DEFAULT_DLQ_GROWTH_PER_HOUR,
    DEFAULT_EMBED_RUN_DEADLINE_SECONDS,
    DEFAULT_EMBED_WORKERS,
    DEFAULT_HEALTH_CRON,
    DEFAULT_PARTITION_BUCKETS,
    DEFAULT_RECONCILE_CRON,
    DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS,
    DagsterConfig,
)
from pipeline_assets.jobs.executor_config import (
    DEFAULT_BACKOFF_BASE_SECONDS,
    DEFAULT_BACKOFF_CAP_SECONDS,
    DEFAULT_CALL_TIMEOUT_SECONDS,
    DEFAULT_MAX_THROTTLES,
    DEFAULT_RETRY_AFTER_CAP_SECONDS,
    ExecutorConfig,
)
from pipeline_assets.jobs.worker_config import DEFAULT_WORKER_DEAD_AFTER_SECONDS, NO_TOKEN_BUDGET, WorkerConfig
from pipeline_assets.providers.provider_config import (
    DEFAULT_BATCH_INPUTS,
    DEFAULT_BATCH_TOKENS,
    DEFAULT_LOCAL_BATCH_INPUTS,
    MAX_BATCH_INPUTS,
    ProviderConfig,
)
from pipeline_assets.registry.registry_config import DEFAULT_INDEX_BUILD_MEMORY, DEFAULT_MODEL_RETIRE_GRACE_SECONDS
from pipeline_assets.store.database_config import DEFAULT_HOME, DEFAULT_POOL_MODE, DatabaseConfig

T = TypeVar("T")  # a setting's type: its default's

class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message names the variable."""


def _setting(env: str, default: T, doc: str, *, secret: bool = False, shown_default: str | None = None) -> T:
    return field(default=default, repr=not secret,
                 metadata={"env": env, "doc": doc, "secret": secret, "shown_default": shown_default})


@dataclass(frozen=True)
class Settings:
    # -- where things are --------------------------------------------------------
    database_url: str | None = _setting(
        "PIPELINE_DATABASE_URL", None,
        "PostgreSQL with pgvector; when set, no server is ever started", secret=True,
        shown_default="unset: embedded server under `PIPELINE_HOME`")
    home: Path = _setting("PIPELINE_HOME", DEFAULT_HOME, "embedded server data (and `dev`'s DAGSTER_HOME)",
                          shown_default="`./.pipeline`")
    source_dir: str = _setting("PIPELINE_SOURCE_DIR", "examples/corpus", "the directory the Dagster sensors watch")
    source: str | None = _setting("PIPELINE_SOURCE", None, "the source the Dagster sensors watch: a folder, "
                                  "`s3://BUCKET/PREFIX` or `table:...`", shown_default="`PIPELINE_SOURCE_DIR`")
    aws_endpoint_url: str | None = _setting("AWS_ENDPOINT_URL", None, "S3-compatible endpoint (MinIO, R2, GCS)",
                                            shown_default="AWS S3")
    source_database_url: str | None = _setting("PIPELINE_SOURCE_DATABASE_URL", None, "the database of `table:` "
                                               "sources", secret=True, shown_default="unset: the project's database")
    database_pool_mode: str = _setting("PIPELINE_DATABASE_POOL_MODE", DEFAULT_POOL_MODE,
                                       "`transaction`: the URL is a transaction-pooling PgBouncer (< 1.21); "
                                       "nothing is prepared server-side")
    dagster_database: str = _setting("PIPELINE_DAGSTER_DATABASE", "dagster",
                                     "database for Dagster's own storage, created by `dev` on the same server")

    # -- the provider -----------------------------------------------------------------
    openai_api_key: str | None = _setting(
        "OPENAI_API_KEY", None, "key for the OpenAI-compatible provider; never printed, logged or stored",
        secret=True, shown_default="unset: the offline model")
    openai_base_url: str | None = _setting("OPENAI_BASE_URL", None, "any OpenAI-compatible server",
                                           shown_default="the SDK's default")
    embedding_model: str | None = _setting(
        "PIPELINE_EMBEDDING_MODEL", None, "the active model",
        shown_default="`text-embedding-3-small` with a key, else `local-hashing`")
    embedding_dimensions: int | None = _setting("PIPELINE_EMBEDDING_DIMENSIONS", None,
                                                "sent as `dimensions`; part of the model id",
                                                shown_default="model default")
    model_retire_grace: float = _setting("PIPELINE_MODEL_RETIRE_GRACE", DEFAULT_MODEL_RETIRE_GRACE_SECONDS,
                                         "a retired model's vectors and index are deleted by reconcile this long "
                                         "after `models retire` (s)", shown_default="7 days")
    index_build_memory: int = _setting("PIPELINE_INDEX_BUILD_MEMORY", DEFAULT_INDEX_BUILD_MEMORY,
                                       "most `maintenance_work_mem` of a vector index build, in bytes (sized to "
                                       "the HNSW graph, never below the server's)", shown_default="2 GiB")
    call_timeout: float = _setting("PIPELINE_CALL_TIMEOUT", DEFAULT_CALL_TIMEOUT_SECONDS,
                                   "wall-clock limit of one provider request, however its answer trickles in (s)")
    worker_dead_after: float = _setting("PIPELINE_WORKER_DEAD_AFTER", DEFAULT_WORKER_DEAD_AFTER_SECONDS,
                                        "a worker silent this long is dead; its claims are rescued (s)")
    batch_inputs: int = _setting("PIPELINE_BATCH_INPUTS", DEFAULT_BATCH_INPUTS,
                                 f"inputs per provider request (≤ {MAX_BATCH_INPUTS})")
    batch_tokens: int = _setting("PIPELINE_BATCH_TOKENS", DEFAULT_BATCH_TOKENS, "tokens per provider request")

    # -- retries and budgets --------------------------------------------------------
    max_attempts: int = _setting("PIPELINE_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS,
                                 "attempts before a job is dead-lettered")
    backoff_base: float = _setting("PIPELINE_BACKOFF_BASE", DEFAULT_BACKOFF_BASE_SECONDS,
                                   "full-jitter backoff `uniform(0, min(cap, base·2^attempt))`: base (s)")
    backoff_cap: float = _setting("PIPELINE_BACKOFF_CAP", DEFAULT_BACKOFF_CAP_SECONDS, "full-jitter backoff: cap (s)")
    retry_after_cap: float = _setting("PIPELINE_RETRY_AFTER_CAP", DEFAULT_RETRY_AFTER_CAP_SECONDS,
                                      "longest pause a provider's Retry-After may impose (s)")
    max_throttles: int = _setting("PIPELINE_MAX_THROTTLES", DEFAULT_MAX_THROTTLES,
                                  "429s one input may meet; one more while alone in its request dead-letters it "
                                  "(`throttled_too_often`)")
    daily_token_budget: int = _setting("PIPELINE_DAILY_TOKEN_BUDGET", NO_TOKEN_BUDGET,
                                       "stop claiming once the model's tokens today (UTC) reach it; 0 = none")
    run_token_budget: int = _setting("PIPELINE_RUN_TOKEN_BUDGET", NO_TOKEN_BUDGET,
                                     "stop claiming once this run's tokens reach it; 0 = none")

    # -- content ------------------------------------------------------------------------
    max_input_bytes: int = _setting("PIPELINE_MAX_INPUT_BYTES", DEFAULT_MAX_INPUT_BYTES,
                                    "larger files are quarantined (`too_large`) without being read",
                                    shown_default="20 MiB")
    stage_timeout: float = _setting("PIPELINE_STAGE_TIMEOUT", DEFAULT_STAGE_TIMEOUT_SECONDS,
                                    "wall-clock limit of extract + chunk per document (s); over it twice"
                                    " (each in a fresh process): `timeout`")
    extract_memory: int = _setting("PIPELINE_EXTRACT_MEMORY", DEFAULT_EXTRACT_MEMORY,
                                   "address space one extraction may add, in bytes; over it: `memory_limit`; 0 = none",
                                   shown_default="2 GiB")
    extract_processes: int = _setting("PIPELINE_EXTRACT_PROCESSES", DEFAULT_EXTRACT_PROCESSES,
                                      "extraction child processes per ingest at most; 0 = one per usable core")
    max_text_chars: int = _setting("PIPELINE_MAX_TEXT_CHARS", DEFAULT_MAX_TEXT_CHARS,
                                   "extracted characters per document; over it: `text_too_large`")
    max_chunks_per_document: int = _setting("PIPELINE_MAX_CHUNKS_PER_DOCUMENT", DEFAULT_MAX_CHUNKS_PER_DOCUMENT,
                                            "chunks per document; over it: `too_many_chunks`")
    ingest_batch_bytes: int = _setting("PIPELINE_INGEST_BATCH_BYTES", DEFAULT_INGEST_BATCH_BYTES,
                                       "chunk text per ingest transaction, in bytes", shown_default="64 MiB")
    decode_errors: str = _setting("PIPELINE_DECODE_ERRORS", DEFAULT_DECODE_ERRORS,
                                  "`replace` decodes bad UTF-8 with U+FFFD instead of quarantining (`bad_encoding`)")
    # Unset: content.chunking's defaults fitted to the configured model's window (``app.runtime.chunking``).
    chunk_tokens: int | None = _setting(
        "PIPELINE_CHUNK_TOKENS", None, "chunk size in cl100k tokens; a size past a model's window is refused",
        shown_default="`512`, or the largest the configured model's window takes (169 for `local-onnx`)")
    chunk_overlap: int | None = _setting(
        "PIPELINE_CHUNK_OVERLAP", None, "tokens shared by consecutive chunks",
        shown_default="`64`; an eighth of a default chunk size under 512")
    extractor_version: str | None = _setting("PIPELINE_EXTRACTOR_VERSION", None,
                                             "overrides the extractor versions (a dry run of a parser fix): `V` for "
                                             "every format, `pdf=V[,html=W]` for those formats only (text, html, pdf)",
                                             shown_default="`EXTRACTOR_VERSION` in `content/extract.py`")

    # -- Dagster ------------------------------------------------------------------------
    source_sensor_interval: int = _setting("PIPELINE_SOURCE_SENSOR_INTERVAL", DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS,
                                           "seconds between two scans of the source by the source sensor")
    reconcile_cron: str = _setting("PIPELINE_RECONCILE_CRON", DEFAULT_RECONCILE_CRON, "the reconciliation schedule")
    health_cron: str = _setting("PIPELINE_HEALTH_CRON", DEFAULT_HEALTH_CRON, "the asset-check schedule")
    dlq_growth_per_hour: int = _setting("PIPELINE_DLQ_GROWTH_PER_HOUR", DEFAULT_DLQ_GROWTH_PER_HOUR,
                                        "the dead-letter growth check warns above this many new failures per hour")
    embed_workers: str = _setting("PIPELINE_EMBED_WORKERS", DEFAULT_EMBED_WORKERS,
                                  "`external`: Dagster embeddings runs only wait for `work` processes elsewhere")
    embed_run_deadline: float = _setting("PIPELINE_EMBED_RUN_DEADLINE", DEFAULT_EMBED_RUN_DEADLINE_SECONDS,
                                         "an embeddings run fails (with its counts) if its chunks are not ready "
                                         "or failed by then (s)")
    partition_buckets: int = _setting("PIPELINE_PARTITION_BUCKETS", DEFAULT_PARTITION_BUCKETS,
                                      "document buckets (Dagster partitions) of a new database; a database keeps "
                                      "the count it was first used with")

    # -- tests ----------------------------------------------------------------------------
    crashpoint: str | None = _setting("PIPELINE_CRASHPOINT", None,
                                      "tests only: freeze the worker at a named point to be killed")

    # -- model input limits and the local model --------------------------------------------
    # A server's model window cannot be asked over the OpenAI API; known OpenAI
    # models carry theirs (8191). Without it a chunk past the window would be
    # silently truncated by servers such as TEI or infinity, so a model outside
    # the provider's table is refused until it is set.
    model_max_input_tokens: int | None = _setting(
        "PIPELINE_MODEL_MAX_INPUT_TOKENS", None,
        "input window of the OpenAI-compatible server's model, in its own tokens; chunks are checked against it",
        shown_default="OpenAI's models: 8191; others: none, and `models add`, `work`, `embed` and Dagster "
                      "refuse the model until it is set")
    price_per_million_tokens: float | None = _setting(
        "PIPELINE_PRICE_PER_MILLION_TOKENS", None, "USD per million input tokens of a model without a built-in "
        "price, for the dry runs' cost estimate", shown_default="OpenAI's models: built in; local models: free")
    local_model_dir: Path | None = _setting(
        "PIPELINE_LOCAL_MODEL_DIR", None,
        "directory of the `local-onnx` model (`model.onnx`, `tokenizer.json`, the model card's configs); "
        "read offline", shown_default="unset: `local-onnx` is refused")
    local_batch_inputs: int = _setting("PIPELINE_LOCAL_BATCH_INPUTS", DEFAULT_LOCAL_BATCH_INPUTS,
                                       "inputs per call of the local ONNX model")

    def __post_init__(self) -> None:
        checks = [
            (self.model_retire_grace >= 0, "model_retire_grace", "must not be negative"),
            (self.price_per_million_tokens is None or self.price_per_million_tokens >= 0,
             "price_per_million_tokens", "must not be negative"),
        ]
        for ok, name, problem in checks:
            if not ok:
                raise SettingsError(f"{_env_of(name)} {problem}, got {getattr(self, name)!r}")
        try:  # each component's own checks, named by their variable
            self.provider_config()
            self.worker_config()
            self.ingest_config()
            self.dagster_config()
            DatabaseConfig(pool_mode=self.database_pool_mode)
        except InvalidConfig as exc:
            name = _SETTING_OF.get(exc.name, exc.name)
            raise SettingsError(f"{_env_of(name)} {exc.problem}, got {exc.value!r}") from None

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read every setting from ``environ`` (default: ``os.environ``), once."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is not None and raw.strip() != "":
                values[f.name] = _parse(f, raw.strip())
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        """A copy with some values changed (``None`` keeps the current value)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    # -- derived values ----------------------------------------------------------------
    @property
    def prepare(self) -> bool:
        """Whether statements may be prepared server-side (not through a transaction pooler)."""
        return DatabaseConfig(pool_mode=self.database_pool_mode).prepare

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser().resolve()

    # -- the components' configs ----------------------------------------------------------
    def provider_config(self) -> ProviderConfig:
        return ProviderConfig(model=self.embedding_model, api_key=self.openai_api_key, base_url=self.openai_base_url,
                              dimensions=self.embedding_dimensions, call_timeout=self.call_timeout,
                              batch_inputs=self.batch_inputs, batch_tokens=self.batch_tokens,
                              max_input_tokens=self.model_max_input_tokens, local_model_dir=self.local_model_dir,
                              local_batch_inputs=self.local_batch_inputs)

    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(call_timeout=self.call_timeout, backoff_base=self.backoff_base,
                              backoff_cap=self.backoff_cap, retry_after_cap=self.retry_after_cap,
                              max_throttles=self.max_throttles, crashpoint=self.crashpoint)

    def worker_config(self, **options: Any) -> WorkerConfig:
        """The worker's config; ``options`` (a command's: concurrency, until_idle, ...) set the
        fields no variable sets (``None`` keeps the default)."""
        return WorkerConfig(worker_dead_after=self.worker_dead_after, index_build_memory=self.index_build_memory,
                            prepare=self.prepare, run_token_budget=self.run_token_budget,
                            daily_token_budget=self.daily_token_budget, executor=self.executor_config(),
                            **{k: v for k, v in options.items() if v is not None})

    def ingest_config(self) -> IngestConfig:
        return IngestConfig(max_bytes=self.max_input_bytes, decode_errors=self.decode_errors,
                            stage_timeout=self.stage_timeout, extract_memory=self.extract_memory,
                            extract_processes=self.extract_processes, max_text_chars=self.max_text_chars,
                            max_chunks=self.max_chunks_per_document, batch_bytes=self.ingest_batch_bytes,
                            max_attempts=self.max_attempts)

    def database_config(self) -> DatabaseConfig:
        return DatabaseConfig(url=self.database_url, home=self.home_path, pool_mode=self.database_pool_mode)

    def source_config(self) -> SourceConfig:
        return SourceConfig(s3_endpoint=self.aws_endpoint_url, retry_base=self.backoff_base, retry_cap=self.backoff_cap,
                            table_database_url=self.source_database_url, database=self.database_config(),
                            max_bytes=self.max_input_bytes, crashpoint=self.crashpoint)

    def dagster_config(self) -> DagsterConfig:
        return DagsterConfig(partition_buckets=self.partition_buckets,
                             source_sensor_interval=self.source_sensor_interval, reconcile_cron=self.reconcile_cron,
                             health_cron=self.health_cron, dlq_growth_per_hour=self.dlq_growth_per_hour,
                             embed_workers=self.embed_workers, embed_run_deadline=self.embed_run_deadline)

    def describe(self) -> dict[str, Any]:
        """Every setting by environment variable, fit to print: the key is only
        "set"/"unset"; a database URL keeps its host but loses its password."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "openai_api_key":
                value = "set" if value else "unset"
            elif f.name in ("database_url", "source_database_url") and value:
                value = redact_text(value)
            out[f.metadata["env"]] = str(value) if isinstance(value, Path) else value
        return out

    def secrets(self) -> list[str]:
        """Values that must never appear in output, logs or the database."""
        return [v for f in dataclasses.fields(self) if f.metadata["secret"]
                for v in [getattr(self, f.name)] if v and f.name == "openai_api_key"]


def redact_text(text: str) -> str:
    """Text fit to print: no password in a connection string, in any of its forms."""
    tails: set[str] = set()

    def hide(match: re.Match) -> str:
        # A password containing "@": a parser that stops at its first "@" (libpq) takes the
        # rest for the host and may echo it ("failed to resolve host 'rest@db'").
        parts = match.group(2).split("@")
        tails.update("@".join(parts[i:]) for i in range(1, len(parts)))
        return match.group(1) + "***@"

    # scheme://user:pass@host: up to the last "@" of the URL, so all of such a password is hidden
    text = re.sub(r"(://[^:/@\s]*:)(\S*)@", hide, text)
    for tail in sorted(filter(None, tails), key=len, reverse=True):
        text = text.replace(tail + "@", "***@")
    text = re.sub(r"(?i)(password\s*=\s*)('[^']*'|[^\s&]+)", r"\1***", text)  # key=value / ?password=
    return text


# A component config's field -> the setting it is read from, where their names differ.
_SETTING_OF = {"max_bytes": "max_input_bytes", "max_chunks": "max_chunks_per_document",
               "batch_bytes": "ingest_batch_bytes", "pool_mode": "database_pool_mode",
               "dimensions": "embedding_dimensions", "max_input_tokens": "model_max_input_tokens"}


def _env_of(name: str) -> str:
    for f in dataclasses.fields(Settings):
        if f.name == name:
            return f.metadata["env"]
    return name


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    env = f.metadata["env"]
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("Path"):
            return Path(raw)
    except ValueError:
        expected = "an integer" if kind.startswith("int") else "a number"
        raise SettingsError(f"{env} must be {expected}, got {raw!r}") from None
    if f.name in ("decode_errors", "database_pool_mode"):
        return raw.lower()
    return raw
