"""Every setting in one place: one typed, immutable ``Settings``, built once.

``Settings.from_env()`` reads the environment exactly once (at the edge: the
command line, the Dagster definitions or a resource) and the object is passed
down; nothing below reads ``os.environ``. Each field names its environment
variable, its default and what it bounds. The README's configuration table is
generated from this module (``python -m pipeline_assets.settings``) and a test
checks that the two agree, so the documentation cannot drift.

Constants that are not meant to be tuned per deployment (poll intervals, the
breaker threshold, batch sizes of internal statements) are named module
constants below, each with the reason for its value.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# -- fixed bounds (not settings) ---------------------------------------------------

# Inputs per provider request allowed by the OpenAI API.
MAX_BATCH_INPUTS = 2048

# Provider requests in flight per worker process (`work --concurrency`).
DEFAULT_CONCURRENCY = 4

# How long a claimed job belongs to its worker before another may rescue it.
# Heartbeats extend it while a call is healthy, so it only bounds how long a
# dead worker's jobs stay stuck (`work --lease-seconds`).
DEFAULT_LEASE_SECONDS = 60.0

# How often an idle worker polls for new work, and how often it rescues
# expired leases of dead workers.
IDLE_POLL_SECONDS = 0.5
RESCUE_INTERVAL_SECONDS = 5.0

# Consecutive provider failures (5xx, timeouts, connection errors) that trip
# the shared circuit breaker; a 429 trips it at once.
BREAKER_THRESHOLD = 5

# Documents written per ingest transaction: bounds the length of the
# transactions that hold the ingest write lock.
INGEST_BATCH_DOCUMENTS = 200

# How much of a provider error message is kept in the database.
ERROR_MESSAGE_MAX_CHARS = 500

DECODE_POLICIES = ("strict", "replace")


class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message names the variable."""


def _setting(env: str, default: Any, doc: str, *, secret: bool = False, shown_default: str | None = None):
    return field(default=default, repr=not secret,
                 metadata={"env": env, "doc": doc, "secret": secret, "shown_default": shown_default})


@dataclass(frozen=True)
class Settings:
    # -- where things are --------------------------------------------------------
    database_url: str | None = _setting(
        "PIPELINE_DATABASE_URL", None,
        "PostgreSQL with pgvector; when set, no server is ever started", secret=True,
        shown_default="unset: embedded server under `PIPELINE_HOME`")
    home: Path = _setting("PIPELINE_HOME", Path("./.pipeline"), "embedded server data (and `dev`'s DAGSTER_HOME)",
                          shown_default="`./.pipeline`")
    source_dir: str = _setting("PIPELINE_SOURCE_DIR", "examples/corpus", "the directory the Dagster sensors watch")
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
    # Wall-clock limit of one provider request; a stalled call becomes an
    # ordinary retryable failure instead of holding a worker (and its lease).
    call_timeout: float = _setting("PIPELINE_CALL_TIMEOUT", 60.0, "wall-clock limit of one provider request (s)")
    batch_inputs: int = _setting("PIPELINE_BATCH_INPUTS", 256, f"inputs per provider request (≤ {MAX_BATCH_INPUTS})")
    batch_tokens: int = _setting("PIPELINE_BATCH_TOKENS", 100_000, "tokens per provider request")

    # -- retries and budgets --------------------------------------------------------
    max_attempts: int = _setting("PIPELINE_MAX_ATTEMPTS", 5, "attempts before a job is dead-lettered")
    backoff_base: float = _setting("PIPELINE_BACKOFF_BASE", 1.0,
                                   "full-jitter backoff `uniform(0, min(cap, base·2^attempt))`: base (s)")
    backoff_cap: float = _setting("PIPELINE_BACKOFF_CAP", 60.0, "full-jitter backoff: cap (s)")
    daily_token_budget: int = _setting("PIPELINE_DAILY_TOKEN_BUDGET", 0,
                                       "stop claiming once the model's tokens today (UTC) reach it; 0 = none")
    run_token_budget: int = _setting("PIPELINE_RUN_TOKEN_BUDGET", 0,
                                     "stop claiming once this run's tokens reach it; 0 = none")

    # -- content ------------------------------------------------------------------------
    # Bounds the memory of one extraction and rejects stray huge files (dumps,
    # videos) before a byte is read.
    max_input_bytes: int = _setting("PIPELINE_MAX_INPUT_BYTES", 20 * 1024 * 1024,
                                    "larger files are quarantined (`too_large`) without being read",
                                    shown_default="20 MiB")
    stage_timeout: float = _setting("PIPELINE_STAGE_TIMEOUT", 60.0,
                                    "wall-clock limit of extract + chunk per document (s); over it: `timeout`")
    decode_errors: str = _setting("PIPELINE_DECODE_ERRORS", "strict",
                                  "`replace` decodes bad UTF-8 with U+FFFD instead of quarantining (`bad_encoding`)")
    chunk_tokens: int = _setting("PIPELINE_CHUNK_TOKENS", 512, "chunk size in cl100k tokens")
    chunk_overlap: int = _setting("PIPELINE_CHUNK_OVERLAP", 64, "tokens shared by consecutive chunks")
    extractor_version: str | None = _setting("PIPELINE_EXTRACTOR_VERSION", None,
                                             "overrides the extractor's code version (a dry run of a parser fix)",
                                             shown_default="`EXTRACTOR_VERSION` in `content/extract.py`")

    # -- Dagster ------------------------------------------------------------------------
    reconcile_cron: str = _setting("PIPELINE_RECONCILE_CRON", "0 * * * *", "the reconciliation schedule")
    health_cron: str = _setting("PIPELINE_HEALTH_CRON", "*/15 * * * *", "the asset-check schedule")
    dlq_growth_per_hour: int = _setting("PIPELINE_DLQ_GROWTH_PER_HOUR", 10,
                                        "the dead-letter growth check fails above this many new failures per hour")
    # Dagster re-reads a run's whole partition list per call, so per-partition
    # metadata is quadratic in the partitions of a run.
    partition_metadata_max: int = _setting("PIPELINE_PARTITION_METADATA_MAX", 100,
                                           "runs over more partitions record a digest instead of per-partition metadata")

    # -- tests ----------------------------------------------------------------------------
    crashpoint: str | None = _setting("PIPELINE_CRASHPOINT", None,
                                      "tests only: freeze the worker at a named point to be killed")

    def __post_init__(self) -> None:
        checks = [
            (self.decode_errors in DECODE_POLICIES, "decode_errors", f"must be one of {DECODE_POLICIES}"),
            (self.max_input_bytes > 0, "max_input_bytes", "must be positive"),
            (self.call_timeout > 0, "call_timeout", "must be positive"),
            (self.max_attempts >= 1, "max_attempts", "must be at least 1"),
            (1 <= self.batch_inputs, "batch_inputs", "must be at least 1"),
            (self.batch_tokens >= 1, "batch_tokens", "must be at least 1"),
            (self.backoff_base >= 0 and self.backoff_cap >= 0, "backoff_base", "backoff must not be negative"),
            (self.embedding_dimensions is None or self.embedding_dimensions > 0, "embedding_dimensions",
             "must be positive"),
        ]
        for ok, name, problem in checks:
            if not ok:
                raise SettingsError(f"{_env_of(name)} {problem}, got {getattr(self, name)!r}")

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Read every setting from ``environ`` (default: ``os.environ``), once."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is not None and raw.strip() != "":
                values[f.name] = _parse(f, raw.strip())
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> "Settings":
        """A copy with some values changed (``None`` keeps the current value)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    # -- derived values ----------------------------------------------------------------
    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser().resolve()

    @property
    def request_inputs(self) -> int:
        return min(self.batch_inputs, MAX_BATCH_INPUTS)

    def describe(self) -> dict[str, Any]:
        """Every setting by environment variable, fit to print: the key is only
        "set"/"unset"; a database URL keeps its host but loses its password."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "openai_api_key":
                value = "set" if value else "unset"
            elif f.name == "database_url" and value:
                value = redact_text(value)
            out[f.metadata["env"]] = str(value) if isinstance(value, Path) else value
        return out

    def secrets(self) -> list[str]:
        """Values that must never appear in output, logs or the database."""
        return [v for f in dataclasses.fields(self) if f.metadata["secret"]
                for v in [getattr(self, f.name)] if v and f.name == "openai_api_key"]


def redact_text(text: str) -> str:
    """Text fit to print: no password in a connection string, in any of its forms."""
    text = re.sub(r"(://[^:/@\s]*:)[^@\s]*@", r"\1***@", text)            # scheme://user:pass@
    text = re.sub(r"(?i)(password\s*=\s*)('[^']*'|[^\s&]+)", r"\1***", text)  # key=value / ?password=
    return text


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
    if f.name == "decode_errors":
        return raw.lower()
    return raw


def reference_table() -> str:
    """The README's configuration table, generated from the fields above."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(Settings):
        if f.name == "crashpoint":
            continue
        shown = f.metadata["shown_default"]
        if shown is None:
            default = f.default
            shown = "unset" if default is None else f"`{default}`"
        lines.append(f"| `{f.metadata['env']}` | {shown} | {f.metadata['doc']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_table())
