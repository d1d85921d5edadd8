"""The runtime of a registered model: the one a worker embeds with, the one search embeds its
query with (the served model's), whatever model is configured; the rest as configured."""

from __future__ import annotations

import dataclasses

from psycopg_pool import ConnectionPool

from pipeline_assets.app.runtime import Runtime, fitted
from pipeline_assets.providers import ConfigError, model_id_for
from pipeline_assets.registry import models
from pipeline_assets.settings import Settings


def runtime_for_model(settings: Settings, name: str, dimensions: int | None = None) -> Runtime:
    """The runtime of a model given by name (and `dimensions` option), the rest as configured (the
    chunking too: fitted to the configured model, not to this one)."""
    return Runtime.build(dataclasses.replace(fitted(settings), embedding_model=name, embedding_dimensions=dimensions))


def runtime_of(
    settings: Settings, pool: ConnectionPool, model_id: str, *, dagster_run_id: str | None = None
) -> Runtime:
    """The runtime that embeds with a registered, active model (or the configured one, which the
    first ingest registers), the rest as configured.

    ConfigError (one line) for a model that is unknown, retired (``models activate`` it
    first), or whose provider this installation cannot build again."""
    with pool.connection() as conn:
        row = models.model_row(conn, model_id)
    if row is not None and not row["active"]:
        raise ConfigError(
            f"model {model_id} is retired; `pipeline-assets models activate {model_id}` to embed with it again"
        )
    if model_id == model_id_for(settings.provider_config()):
        return Runtime.build(settings, dagster_run_id=dagster_run_id)
    if row is None:
        raise ConfigError(f"unknown model {model_id!r}: `pipeline-assets models add` registers it")
    # The model id says provider, name and dimension; the `dimensions` option was
    # either sent (the id's dimension) or not (the model's default).
    for dims in (None, row["dimension"]):
        rt = runtime_for_model(settings, row["name"], dims)
        if rt.model_id == model_id:
            rt.options.dagster_run_id = dagster_run_id
            return rt
    raise ConfigError(
        f"this installation cannot embed with {model_id} (its provider or code is gone); "
        f"`pipeline-assets models retire {model_id}`"
    )


def served_runtime(settings: Settings, pool: ConnectionPool) -> Runtime:
    """The runtime search embeds its query with: the served model's, whatever is configured.

    Before any model is registered, the configured one (there is nothing to read yet).
    Raises ConfigError when this process cannot build the served model's provider
    (e.g. it is an OpenAI model and OPENAI_API_KEY is unset).
    """
    with pool.connection() as conn:
        row = models.served(conn)
    if row is None or row["model_id"] == model_id_for(settings.provider_config()):
        return Runtime.build(settings)
    # The model id says provider, name and dimension; the `dimensions` option was
    # either sent (the id's dimension) or not (the model's default).
    for dims in (None, row["dimension"]):
        rt = runtime_for_model(settings, row["name"], dims)
        if rt.model_id == row["model_id"]:
            return rt
    # E.g. an offline embedder replaced by a new version: its code is gone, its vectors are not.
    configured = model_id_for(settings.provider_config())
    raise ConfigError(
        f"this installation cannot embed a query with the served model {row['model_id']}; "
        f"`pipeline-assets models serve {configured}` once it covers the corpus "
        "(`models list`), or `search --model NAME`"
    )
