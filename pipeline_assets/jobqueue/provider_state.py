"""The provider's state every worker shares (app.provider_state), one statement each
(sql/queries/jobs.sql): the circuit breaker (failures counted, tripped, its half-open probe
slot), a throttle's pause of every worker, and the unusable answers in a row. Its threshold
and probe interval: ``jobqueue.breaker_config``; the claim reads this state (``transitions.claim``).
"""

from __future__ import annotations

import psycopg
from psycopg.rows import dict_row

from pipeline_assets.jobqueue.breaker_config import BREAKER_PROBE_INTERVAL
from pipeline_assets.store import queries

JOBS = queries.load("jobs")


def release_probe(conn: psycopg.Connection, model_id: str, owner: str) -> int:
    """Free the half-open probe slot if the claim ``owner`` holds it."""
    return conn.execute(JOBS.release_probe, {"model": model_id, "owner": owner}).rowcount


def provider_failure(
    conn: psycopg.Connection,
    model_id: str,
    *,
    trip: bool,
    floor: float,
    base: float,
    cap: float,
    threshold: int,
    probe_cap: float = BREAKER_PROBE_INTERVAL,
) -> tuple[bool, bool]:
    """Count a provider failure for every worker; returns (paused now, tripped). A pause
    without a Retry-After (``floor``) lasts at most ``probe_cap``: the next probe goes out
    within it, however long the provider has been failing."""
    row = _row(
        conn,
        JOBS.provider_failure,
        {
            "model": model_id,
            "trip": trip,
            "floor": floor,
            "base": base,
            "cap": cap,
            "threshold": threshold,
            "probe_cap": probe_cap,
        },
    )
    return row["paused"], row["tripped"]


def provider_pause(
    conn: psycopg.Connection,
    model_id: str,
    *,
    floor: float,
    base: float,
    cap: float,
    probe_cap: float = BREAKER_PROBE_INTERVAL,
) -> None:
    """A throttle: every worker pauses claiming for ``floor`` (the Retry-After), or a short
    jittered pause without one; the breaker does not trip: claims resume when it ends."""
    conn.execute(
        JOBS.provider_pause, {"model": model_id, "floor": floor, "base": base, "cap": cap, "probe_cap": probe_cap}
    )


def provider_healthy(conn: psycopg.Connection, model_id: str) -> None:
    conn.execute(JOBS.provider_healthy, {"model": model_id})


def provider_unusable(conn: psycopg.Connection, model_id: str, *, count: bool = True) -> int:
    """Count (``count``) an unusable answer to a single trivial input; returns how many came in a row."""
    row = conn.execute(
        JOBS.provider_unusable if count else JOBS.provider_unusable_count, {"model": model_id}
    ).fetchone()
    return int(row[0]) if row else 0


def provider_usable(conn: psycopg.Connection, model_id: str) -> None:
    conn.execute(JOBS.provider_usable, {"model": model_id})


def _row(conn: psycopg.Connection, query: str, params: dict) -> dict:
    """The first row of one statement, as a dict keyed by column name."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()[0]
