"""Dagster resources, shared by every domain: the database, the embedding provider, the source,
how an embeddings run embeds.

Each resource carries, as its own fields, the values it needs, set once by
``build_resources(settings)`` from the typed ``Settings``: a run in the UI and the command line
agree on the database, the model and every default, and a run's resources (built anew by Dagster
from that config) read nothing else. A secret (a database URL, the API key) is a ``dg.EnvVar``
field: the UI and the run's config show the variable's name, never the value. A run config that
sets any field of a resource (the launchpad) replaces all its configured values; the fields it
leaves unset then read the run process's own environment (``Settings.from_env()``).
``PostgresResource``'s psycopg pool is opened and migrated on first use, closed at teardown.
"""

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import psycopg
from psycopg_pool import ConnectionPool
from pydantic import Field, PrivateAttr

from pipeline_assets.app.runtime import Runtime
from pipeline_assets.app.source_registry import is_folder, open_source
from pipeline_assets.content.folder_source import FolderSource
from pipeline_assets.content.source import Source
from pipeline_assets.providers import ConfigError, model_id_for
from pipeline_assets.settings import Settings
from pipeline_assets.store import bucket_rows, db

_REPO = Path(__file__).resolve().parents[2]
_DEFAULTS = Settings()
# The settings a resource field may only hold as a dg.EnvVar (the name of their variable).
SECRET_FIELDS = tuple(f for f in dataclasses.fields(Settings) if f.metadata["secret"])
_SECRET_NAMES = {f.name for f in SECRET_FIELDS}


def _secret(settings: Settings, name: str) -> str | None:
    """The secret setting ``name`` as a resource field: its variable's ``dg.EnvVar``, or unset."""
    env = next(f.metadata["env"] for f in SECRET_FIELDS if f.name == name)
    return dg.EnvVar(env) if getattr(settings, name) else None


def _resolved(value: str | None) -> str | None:
    """A field's value: an ``EnvVar`` is resolved here when the resource is used outside a run."""
    return value.get_value() if isinstance(value, dg.EnvVar) else value


def settings_environment(settings: Settings) -> dict[str, str]:
    """The non-secret settings that differ from the defaults, by environment variable, as text
    ``Settings.from_env`` reads back to the same values."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if f.name not in _SECRET_NAMES and value is not None and value != getattr(_DEFAULTS, f.name):
            out[f.metadata["env"]] = str(value)
    return out


class PostgresResource(dg.ConfigurableResource):
    """The pipeline's PostgreSQL database (psycopg 3 pool, migrated on first use)."""

    database_url: str | None = Field(
        default=None,
        description="libpq URL of the pipeline database (EnvVar PIPELINE_DATABASE_URL when set). Unset: the "
        "embedded PostgreSQL under `home`.",
    )
    home: str | None = Field(
        default=None,
        description="PIPELINE_HOME: the embedded server's data. Unset: this resource reads the environment's settings.",
    )
    pool_mode: str = Field(
        default=_DEFAULTS.database_pool_mode,
        description="PIPELINE_DATABASE_POOL_MODE: `transaction` prepares no statement.",
    )
    pool_max_size: int = Field(default=4, description="Connections kept by this resource's pool.")

    _pool = PrivateAttr(default=None)

    @classmethod
    def from_settings(cls, settings: Settings) -> "PostgresResource":
        return cls(
            database_url=_secret(settings, "database_url"),
            home=str(settings.home),
            pool_mode=settings.database_pool_mode,
        )

    def _environment(self) -> Settings | None:
        """The environment's settings, for a resource not built from settings (``home`` unset)."""
        return Settings.from_env() if self.home is None else None

    def url(self) -> str:
        if (settings := self._environment()) is not None:
            return db.database_url(settings.database_config())
        return _resolved(self.database_url) or db.embedded_url(Path(str(self.home)).expanduser().resolve())

    def pool(self) -> ConnectionPool:
        """The pool, opened (and the database migrated) on first use."""
        if self._pool is None:
            url = self.url()
            settings = self._environment()
            prepare = settings.prepare if settings is not None else self.pool_mode != "transaction"
            with db.session(url, prepare=prepare):
                pass  # apply pending migrations once, before the pool hands out connections
            self._pool = db.make_pool(url, min_size=1, max_size=self.pool_max_size, prepare=prepare)
        return self._pool

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A pooled autocommit connection to the migrated database."""
        with self.pool().connection() as conn:
            yield conn

    def bucket_count(self, configured: int) -> int:
        """The database's bucket count when ``configured`` is it; otherwise the run fails with
        one line naming the count to set (``dg.Failure``, not retried)."""
        with self.connection() as conn:
            try:
                return bucket_rows.check_buckets(conn, configured)
            except bucket_rows.BucketCountMismatch as exc:
                raise dg.Failure(description=str(exc), allow_retries=False) from None

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class EmbeddingProviderResource(dg.ConfigurableResource):
    """The embedding provider and ingest options, built exactly as the CLI builds them."""

    model: str | None = Field(
        default=None,
        description="Model name; unset: the configured one (PIPELINE_EMBEDDING_MODEL, else "
        "text-embedding-3-small with OPENAI_API_KEY, else the local offline model). Set, it must be "
        "that same model: the code versions are built from the configuration, and a model switch "
        "is a configuration change the model_switch sensor follows.",
    )
    environment: dict[str, str] | None = Field(
        default=None,
        description="The code location's settings other than secrets and defaults, by environment variable "
        "(set when the definitions are built; not a launchpad option). Unset: the environment's.",
    )
    database_url: str | None = Field(default=None, description="EnvVar PIPELINE_DATABASE_URL when set.")
    source_database_url: str | None = Field(default=None, description="EnvVar PIPELINE_SOURCE_DATABASE_URL when set.")
    openai_api_key: str | None = Field(default=None, description="EnvVar OPENAI_API_KEY when set.")

    @classmethod
    def from_settings(cls, settings: Settings) -> "EmbeddingProviderResource":
        return cls(
            environment=settings_environment(settings), **{f.name: _secret(settings, f.name) for f in SECRET_FIELDS}
        )

    def configured(self) -> Settings:
        """The code location's settings, as the definitions were built from them."""
        if self.environment is None:
            return Settings.from_env()
        secrets = {f.metadata["env"]: _resolved(getattr(self, f.name)) for f in SECRET_FIELDS}
        return Settings.from_env({**self.environment, **{k: v for k, v in secrets.items() if v}})

    def settings(self) -> Settings:
        """The code location's settings with this resource's model."""
        return self.configured().replace(embedding_model=self.model)

    def runtime(self, dagster_run_id: str | None = None, *, force: bool = False) -> Runtime:
        rt = Runtime.build(self.settings(), dagster_run_id=dagster_run_id, force=force)
        if self.model and rt.model_id != (configured := model_id_for(self.configured().provider_config())):
            # A launchpad override: it would register a model nobody serves or works, and record
            # vectors of one model under the code version of another (defs/models/sensors.py).
            raise ConfigError(
                f"the run's model {rt.model_id} is not the configured model {configured} (the "
                "embeddings code version); set PIPELINE_EMBEDDING_MODEL and reload the code "
                "location to switch models"
            )
        return rt


class SourceDirectoryResource(dg.ConfigurableResource):
    """The source: a folder, an object store prefix or a table (``app/source_registry.py``)."""

    root: str | None = Field(
        default=None,
        description="The source (a folder path, s3://bucket/prefix, ...); configured (and "
        "unset): PIPELINE_SOURCE, else PIPELINE_SOURCE_DIR.",
    )

    @classmethod
    def from_settings(cls, settings: Settings) -> "SourceDirectoryResource":
        return cls(root=settings.source or settings.source_dir)

    def spec(self) -> str:
        """The source string: this resource's, else the environment's settings'."""
        if self.root:
            return self.root
        settings = Settings.from_env()
        return settings.source or settings.source_dir

    def root_path(self) -> Path:
        """The folder configured (a relative path that is not here: the bundled example's)."""
        path = Path(self.spec()).expanduser()
        if not path.is_absolute() and not path.exists() and (_REPO / path).exists():
            path = _REPO / path  # the bundled example corpus, whatever the working directory
        return path.resolve()

    def source(self, settings: Settings) -> Source:
        """The configured source, opened with ``settings`` (SourceError, one line, for a malformed string)."""
        spec = self.spec()
        return FolderSource(self.root_path()) if is_folder(spec) else open_source(spec, settings.source_config())


class EmbeddingRunResource(dg.ConfigurableResource):
    """How an embeddings run gets its partitions' chunks embedded, and how long it waits."""

    in_process: bool | None = Field(
        default=None,
        description="Embed in the run (a worker claiming only the run's chunks) or only wait for "
        "`pipeline-assets work` processes elsewhere. Configured: PIPELINE_EMBED_WORKERS "
        "(`in-process` by default, `external` for the scale-out path).",
    )
    deadline_seconds: float | None = Field(
        default=None,
        description="The run fails, with ready/failed/outstanding counts, if its chunks are not all ready or "
        "failed by then. Configured: PIPELINE_EMBED_RUN_DEADLINE (3600 s by default).",
    )

    def embeds_in_process(self, settings: Settings) -> bool:
        return self.in_process if self.in_process is not None else settings.embed_workers == "in-process"

    def deadline(self, settings: Settings) -> float:
        return self.deadline_seconds if self.deadline_seconds else settings.embed_run_deadline


def build_resources(settings: Settings) -> dict[str, dg.ConfigurableResource]:
    """The resources, each carrying the values of ``settings`` it needs."""
    return {
        "postgres": PostgresResource.from_settings(settings),
        "embedding_provider": EmbeddingProviderResource.from_settings(settings),
        "source": SourceDirectoryResource.from_settings(settings),
        "embedding_run": EmbeddingRunResource(
            in_process=settings.embed_workers == "in-process", deadline_seconds=settings.embed_run_deadline
        ),
    }
