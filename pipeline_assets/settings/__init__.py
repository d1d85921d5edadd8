"""Every setting in one place: one typed, immutable ``Settings``, built once.

``Settings.from_env()`` reads the environment exactly once (at the edge: the command line, the
Dagster definitions or a resource) and the object is passed down; nothing else reads the environment.
Its variables are declared by component (``locations``, ``provider``, ``queue``, ``content``,
``orchestration``: each field names its variable, its default and what it bounds; ``reading``);
docs/configuration.md is generated from them (``python -m pipeline_assets.settings_reference``,
checked by a test). ``Settings`` only reads: each component gets its own config built here
(``worker_config()``, ``provider_config()``, ...), with its defaults and range checks beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline_assets.app.source_config import SourceConfig
from pipeline_assets.component_config import InvalidConfig
from pipeline_assets.jobqueue.executor_config import ExecutorConfig
from pipeline_assets.jobqueue.worker_config import WorkerConfig
from pipeline_assets.settings.content import ContentSettings
from pipeline_assets.settings.locations import LocationSettings
from pipeline_assets.settings.orchestration import DagsterSettings
from pipeline_assets.settings.provider import ProviderSettings
from pipeline_assets.settings.queue import QueueSettings
from pipeline_assets.settings.reading import SettingsError, env_of, read
from pipeline_assets.settings.redaction import redact_text
from pipeline_assets.store.database_config import DatabaseConfig

__all__ = ["Settings", "SettingsError", "redact_text"]

# A component config's field -> the setting it is read from, where their names differ.
_SETTING_OF = {
    "max_bytes": "max_input_bytes",
    "max_chunks": "max_chunks_per_document",
    "batch_bytes": "ingest_batch_bytes",
    "pool_mode": "database_pool_mode",
    "dimensions": "embedding_dimensions",
    "max_input_tokens": "model_max_input_tokens",
}


# The fields are the components' (locations first, Dagster's last: a dataclass takes its bases'
# fields in reverse order of inheritance); the configs built from more than one are built here.
@dataclass(frozen=True)
class Settings(DagsterSettings, ContentSettings, QueueSettings, ProviderSettings, LocationSettings):
    def __post_init__(self) -> None:
        checks = [
            (self.model_retire_grace >= 0, "model_retire_grace", "must not be negative"),
            (
                self.price_per_million_tokens is None or self.price_per_million_tokens >= 0,
                "price_per_million_tokens",
                "must not be negative",
            ),
        ]
        for ok, name, problem in checks:
            if not ok:
                raise SettingsError(f"{env_of(Settings, name)} {problem}, got {getattr(self, name)!r}")
        try:  # each component's own checks, named by their variable
            self.provider_config()
            self.worker_config()
            self.ingest_config()
            self.dagster_config()
            DatabaseConfig(pool_mode=self.database_pool_mode)
        except InvalidConfig as exc:
            name = _SETTING_OF.get(exc.name, exc.name)
            raise SettingsError(f"{env_of(Settings, name)} {exc.problem}, got {exc.value!r}") from None

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read every setting from ``environ`` (default: the process environment), once."""
        values = read(cls, environ)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        """A copy with some values changed (``None`` keeps the current value)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    # -- the components' configs built from more than one component's variables ------------
    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(
            call_timeout=self.call_timeout,
            backoff_base=self.backoff_base,
            backoff_cap=self.backoff_cap,
            retry_after_cap=self.retry_after_cap,
            max_throttles=self.max_throttles,
            crashpoint=self.crashpoint,
        )

    def worker_config(self, **options: Any) -> WorkerConfig:
        """The worker's config; ``options`` (a command's: concurrency, until_idle, ...) set the
        fields no variable sets (``None`` keeps the default)."""
        return WorkerConfig(
            worker_dead_after=self.worker_dead_after,
            index_build_memory=self.index_build_memory,
            prepare=self.prepare,
            run_token_budget=self.run_token_budget,
            daily_token_budget=self.daily_token_budget,
            executor=self.executor_config(),
            **{k: v for k, v in options.items() if v is not None},
        )

    def source_config(self) -> SourceConfig:
        return SourceConfig(
            s3_endpoint=self.aws_endpoint_url,
            retry_base=self.backoff_base,
            retry_cap=self.backoff_cap,
            table_database_url=self.source_database_url,
            database=self.database_config(),
            max_bytes=self.max_input_bytes,
            crashpoint=self.crashpoint,
        )

    # -- shown ------------------------------------------------------------------------------
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
        return [
            v
            for f in dataclasses.fields(self)
            if f.metadata["secret"]
            for v in [getattr(self, f.name)]
            if v and f.name == "openai_api_key"
        ]
