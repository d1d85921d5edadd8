"""Dagster resources, shared by every domain: the database, the embedding provider, the source,
how an embeddings run embeds.

Each turns its config into what the use cases of ``pipeline_assets.app`` take (a pool, a
``Runtime``, a ``Source``). Unset fields read the settings the definitions were built from
(``build_resources(settings)``, found by ``settings_id``), so a run in the UI and the command
line agree on the database, the model and every default; a field set in the launchpad
overrides them. ``PostgresResource`` takes ``database_url`` from ``EnvVar("PIPELINE_DATABASE_URL")``
when set (the UI shows the name, never the password), else the embedded server under
PIPELINE_HOME; its psycopg pool is opened and migrated on first use, closed at teardown.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import psycopg
from psycopg_pool import ConnectionPool
from pydantic import Field, PrivateAttr

from pipeline_assets.app import buckets as bk
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.app.source_registry import is_folder, open_source
from pipeline_assets.content.folder_source import FolderSource
from pipeline_assets.content.source import Source
from pipeline_assets.providers import ConfigError, model_id_for
from pipeline_assets.settings import Settings
from pipeline_assets.store import db

DATABASE_URL_ENV = "PIPELINE_DATABASE_URL"
_REPO = Path(__file__).resolve().parents[2]

# The settings each Definitions of this process was built from, by id. Dagster
# builds resource instances anew from their config (a launchpad override, every
# run's resource init) and drops anything else they hold, so a resource carries
# only the id (``settings_id``) and reads its settings here.
_SETTINGS: dict[str, Settings] = {}
SETTINGS_ID_HELP = ("Which settings of this code location the resource reads (set when the definitions are "
                    "built from the environment; not a launchpad option).")


def register_settings(settings: Settings) -> str:
    """The id ``settings`` are kept under in this process (equal settings, the same id)."""
    for key, known in _SETTINGS.items():
        if known == settings:
            return key
    key = f"settings-{len(_SETTINGS) + 1}"
    _SETTINGS[key] = settings
    return key


def settings_of(settings_id: str | None) -> Settings:
    """The settings registered under an id; a resource built by hand (no id) reads the environment."""
    if settings_id is not None and settings_id in _SETTINGS:
        return _SETTINGS[settings_id]
    return Settings.from_env()


class PostgresResource(dg.ConfigurableResource):
    """The pipeline's PostgreSQL database (psycopg 3 pool, migrated on first use)."""

    database_url: str | None = Field(
        default=None,
        description="libpq URL of the pipeline database. Unset: PIPELINE_DATABASE_URL, else the embedded "
                    "PostgreSQL under PIPELINE_HOME.")
    pool_max_size: int = Field(default=4, description="Connections kept by this resource's pool.")
    settings_id: str | None = Field(default=None, description=SETTINGS_ID_HELP)

    _pool = PrivateAttr(default=None)

    @classmethod
    def from_settings(cls, settings: Settings) -> "PostgresResource":
        key = register_settings(settings)
        if settings.database_url:
            return cls(database_url=dg.EnvVar(DATABASE_URL_ENV), settings_id=key)
        return cls(settings_id=key)

    def url(self) -> str:
        value = self.database_url
        if isinstance(value, dg.EnvVar):  # used directly, outside a run or sensor
            value = value.get_value()
        return value or db.database_url(settings_of(self.settings_id))

    def pool(self) -> ConnectionPool:
        """The pool, opened (and the database migrated) on first use."""
        if self._pool is None:
            url = self.url()
            prepare = settings_of(self.settings_id).prepare
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
                return bk.check_buckets(conn, configured)
            except bk.BucketCountMismatch as exc:
                raise dg.Failure(description=str(exc), allow_retries=False) from None

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class EmbeddingProviderResource(dg.ConfigurableResource):
    """The embedding provider and ingest options, built exactly as the CLI builds them."""

    model: str | None = Field(
        default=None,
        description="Model name; unset: PIPELINE_EMBEDDING_MODEL, else text-embedding-3-small with "
                    "OPENAI_API_KEY, else the local offline model. Set, it must be that same model: the "
                    "code versions are built from the configuration, and a model switch is a configuration "
                    "change the model_switch sensor follows.")
    settings_id: str | None = Field(default=None, description=SETTINGS_ID_HELP)

    def settings(self) -> Settings:
        """The code location's settings with this resource's model."""
        return settings_of(self.settings_id).replace(embedding_model=self.model)

    def runtime(self, run_id: str | None = None, *, force: bool = False) -> Runtime:
        rt = Runtime.build(self.settings(), run_id=run_id, force=force)
        if self.model and rt.model_id != (configured := model_id_for(settings_of(self.settings_id))):
            # A launchpad override: it would register a model nobody serves or works, and record
            # vectors of one model under the code version of another (defs/models/sensors.py).
            raise ConfigError(f"the run's model {rt.model_id} is not the configured model {configured} (the "
                              "embeddings code version); set PIPELINE_EMBEDDING_MODEL and reload the code "
                              "location to switch models")
        return rt


class SourceDirectoryResource(dg.ConfigurableResource):
    """The source: a folder, an object store prefix or a table (``app/source_registry.py``)."""

    root: str | None = Field(
        default=None, description="The source (a folder path, s3://bucket/prefix, ...); unset: "
                                  "PIPELINE_SOURCE, else PIPELINE_SOURCE_DIR, else examples/corpus.")
    settings_id: str | None = Field(default=None, description=SETTINGS_ID_HELP)

    def spec(self, settings: Settings | None = None) -> str:
        """The source string configured (this resource's, else the settings')."""
        settings = settings or settings_of(self.settings_id)
        return self.root or settings.source or settings.source_dir

    def root_path(self, settings: Settings | None = None) -> Path:
        """The folder configured (a relative path that is not here: the bundled example's)."""
        path = Path(self.spec(settings)).expanduser()
        if not path.is_absolute() and not path.exists() and (_REPO / path).exists():
            path = _REPO / path  # the bundled example corpus, whatever the working directory
        return path.resolve()

    def source(self, settings: Settings | None = None) -> Source:
        """The configured source, opened (SourceError, one line, for a malformed string)."""
        settings = settings or settings_of(self.settings_id)
        spec = self.spec(settings)
        return FolderSource(self.root_path(settings)) if is_folder(spec) else open_source(spec, settings)


class EmbeddingRunResource(dg.ConfigurableResource):
    """How an embeddings run gets its partitions' chunks embedded, and how long it waits."""

    in_process: bool | None = Field(
        default=None,
        description="Embed in the run (a worker claiming only the run's chunks) or only wait for "
                    "`pipeline-assets work` processes elsewhere. Unset: PIPELINE_EMBED_WORKERS "
                    "(`in-process` by default, `external` for the scale-out path).")
    deadline_seconds: float | None = Field(
        default=None,
        description="The run fails, with ready/failed/outstanding counts, if its chunks are not all ready or "
                    "failed by then. Unset: PIPELINE_EMBED_RUN_DEADLINE (3600 s by default).")

    def embeds_in_process(self, settings: Settings) -> bool:
        return self.in_process if self.in_process is not None else settings.embed_workers == "in-process"

    def deadline(self, settings: Settings) -> float:
        return self.deadline_seconds if self.deadline_seconds else settings.embed_run_deadline


def build_resources(settings: Settings) -> dict[str, dg.ConfigurableResource]:
    """The resources, reading ``settings`` (kept in this process under their id)."""
    key = register_settings(settings)
    return {
        "postgres": PostgresResource.from_settings(settings),
        "embedding_provider": EmbeddingProviderResource(settings_id=key),
        "source": SourceDirectoryResource(settings_id=key),
        "embedding_run": EmbeddingRunResource(),
    }
