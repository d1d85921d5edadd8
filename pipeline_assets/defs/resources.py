"""Dagster resources: the database, the embedding provider, the source directory.

Thin wrappers over the core. Each one resolves its setting the same way the
CLI does, so a run in the UI and ``pipeline-assets embed`` agree on the
database, the model and its defaults:

* ``PostgresResource``: ``database_url`` comes from ``EnvVar("PIPELINE_DATABASE_URL")``
  when that variable is set (the UI then shows the variable's name, never the
  URL and its password); unset, ``db.database_url()`` starts or reuses the
  embedded server under PIPELINE_HOME, exactly as the CLI does. Connections come
  from a psycopg 3 pool, opened on first use, migrated once, closed at teardown.
* ``EmbeddingProviderResource``: ``runtime_from_env`` (the CLI's entry point):
  OpenAI-compatible when OPENAI_API_KEY is set, the local offline model otherwise.
* ``SourceDirectoryResource``: the directory whose files are the partitions;
  ``root`` field, else PIPELINE_SOURCE_DIR, else ``examples/corpus``.
"""

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import dagster as dg
import psycopg
from pydantic import Field, PrivateAttr

from pipeline_assets.store import db
from pipeline_assets.providers import ConfigError, configured_model_name, provider_from_env
from pipeline_assets.app.runtime import Runtime, runtime_from_env

DATABASE_URL_ENV = "PIPELINE_DATABASE_URL"
SOURCE_DIR_ENV = "PIPELINE_SOURCE_DIR"
DEFAULT_SOURCE_DIR = "examples/corpus"
_REPO = Path(__file__).resolve().parents[2]


class PostgresResource(dg.ConfigurableResource):
    """The pipeline's PostgreSQL database (psycopg 3 pool, migrated on first use)."""

    database_url: Optional[str] = Field(
        default=None,
        description="libpq URL of the pipeline database. Unset: PIPELINE_DATABASE_URL, else the embedded "
                    "PostgreSQL under PIPELINE_HOME.")
    pool_max_size: int = Field(default=4, description="Connections kept by this resource's pool.")

    _pool = PrivateAttr(default=None)

    @classmethod
    def from_env(cls) -> "PostgresResource":
        if os.environ.get(DATABASE_URL_ENV):
            return cls(database_url=dg.EnvVar(DATABASE_URL_ENV))
        return cls()

    def url(self) -> str:
        value = self.database_url
        if isinstance(value, dg.EnvVar):  # used directly, outside a run or sensor
            value = value.get_value()
        return value or db.database_url()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A pooled autocommit connection to the migrated database."""
        if self._pool is None:
            url = self.url()
            with db.session(url):
                pass  # apply pending migrations once, before the pool hands out connections
            self._pool = db.make_pool(url, min_size=1, max_size=self.pool_max_size)
        with self._pool.connection() as conn:
            yield conn

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class EmbeddingProviderResource(dg.ConfigurableResource):
    """The embedding provider and ingest options, built exactly as the CLI builds them."""

    model: Optional[str] = Field(
        default=None,
        description="Model name; unset: PIPELINE_EMBEDDING_MODEL, else text-embedding-3-small with "
                    "OPENAI_API_KEY, else the local offline model.")

    def runtime(self, run_id: str | None = None) -> Runtime:
        return runtime_from_env(self.model, run_id=run_id)


class SourceDirectoryResource(dg.ConfigurableResource):
    """The source directory: one file = one document = one partition."""

    root: Optional[str] = Field(
        default=None, description="Source directory; unset: PIPELINE_SOURCE_DIR, else examples/corpus.")

    def root_path(self) -> Path:
        raw = self.root or os.environ.get(SOURCE_DIR_ENV) or DEFAULT_SOURCE_DIR
        path = Path(raw).expanduser()
        if not path.is_absolute() and not path.exists() and (_REPO / path).exists():
            path = _REPO / path  # the bundled example corpus, whatever the working directory
        return path.resolve()


def embedding_model_id(model: str | None = None) -> str:
    """The configured model's id (``provider/name@dimension``), for code versions.

    Never raises: a missing key is reported when a run needs the provider, not
    when the definitions load.
    """
    try:
        return provider_from_env(model).spec.model_id
    except (ConfigError, ValueError) as exc:
        return f"unconfigured/{model or configured_model_name()} ({type(exc).__name__})"


def resources_from_env() -> dict[str, dg.ConfigurableResource]:
    return {
        "postgres": PostgresResource.from_env(),
        "embedding_provider": EmbeddingProviderResource(),
        "source": SourceDirectoryResource(),
    }
