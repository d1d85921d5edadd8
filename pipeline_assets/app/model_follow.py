"""A model change without downtime, as the Dagster layer follows the configured model each tick:
add it, keep serving the old one until it covers every current chunk, then serve it and retire
the one it replaced."""

from __future__ import annotations

import dataclasses

from psycopg_pool import ConnectionPool

from pipeline_assets.app.runtime import Runtime
from pipeline_assets.jobqueue import transitions
from pipeline_assets.registry import models
from pipeline_assets.store import documents


@dataclasses.dataclass
class ModelFollowed:
    """What one ``follow_configured`` call did."""

    model_id: str  # the configured model
    added: bool  # registered by this call (jobs for every current chunk)
    enqueued: int
    served: str | None  # the model search reads after this call
    switched: bool  # this call served the configured model
    switched_from: str | None  # the model it replaced, when it switched
    retired: str | None  # the same model, retired (reconcile deletes its vectors later)
    coverage: models.Coverage | None  # the configured model's; None when no switch is pending


def follow_configured(rt: Runtime, pool: ConnectionPool, *, switch: bool = True) -> ModelFollowed:
    """A model change without downtime, done by the Dagster layer (``defs/models/sensors.py``) each tick.

    ``add`` the configured model (a new one gets jobs for every current chunk; a retired one raises
    ``ModelRetired``, as everywhere). While another model is served it stays served; once the configured
    model covers every current chunk it is served and the one it replaced retired (reconcile deletes
    those vectors after the grace period). ``switch=False`` only adds: the caller switched to this model
    once already, and a person who served another one since is not overruled. The result's coverage is
    None when no switch is pending (reading it reads every current chunk).
    """
    model_id = rt.model_id
    with pool.connection() as conn, conn.transaction():
        added = models.ensure_model(conn, rt.provider.spec)
        enqueued = 0
        if added:
            documents.write_lock(conn)
            enqueued = transitions.enqueue_missing(conn, rt.settings.max_attempts)
    switched, switched_from, retired = False, None, None
    with pool.connection() as conn:
        served = models.served_model_id(conn)
        pending = switch and served != model_id
        # Coverage reads every current chunk: only while a switch is pending (or the model is new).
        cov = models.coverage(conn, model_id) if pending or added else None
        if pending and cov is not None and cov.complete:
            with conn.transaction():
                documents.write_lock(conn)  # no chunk arrives between the check and the switch
                cov = models.coverage(conn, model_id)
                if cov.complete:
                    changed, previous = models.serve(conn, model_id)
                    if changed:
                        served, switched, switched_from = model_id, True, previous
                        if previous:
                            models.retire(conn, previous)
                            retired = previous
    return ModelFollowed(
        model_id=model_id,
        added=added,
        enqueued=enqueued,
        served=served,
        switched=switched,
        switched_from=switched_from,
        retired=retired,
        coverage=cov,
    )
