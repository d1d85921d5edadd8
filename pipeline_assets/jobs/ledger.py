"""The spend ledger: every provider call, and how often each input was sent.

An input counts as sent when the provider answered, or when the call's outcome
is ambiguous (timeout, dropped connection: it may have been computed and
billed). Inputs sent more than once for the same content and model are the
duplicate spend that ``status`` reports.
"""

from __future__ import annotations

from typing import Sequence

import psycopg

from pipeline_assets.jobs import queries


def record_call(conn: psycopg.Connection, *, model_id: str, worker_id: str, jobs: Sequence, tokens: int,
                outcome: str, status: int | None, latency: float, billed: bool) -> None:
    conn.execute(queries.RECORD_CALL, {"model": model_id, "worker": worker_id, "tokens": tokens,
                                       "outcome": outcome, "status": status, "latency": int(latency * 1000),
                                       "checksums": [j.chunk_checksum for j in jobs], "billed": billed})


def tokens_today(conn: psycopg.Connection, model_id: str) -> int:
    """Tokens billed for the model since midnight UTC."""
    return conn.execute(
        "SELECT coalesce(sum(tokens), 0) FROM app.provider_calls"
        " WHERE model_id = %s AND called_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'",
        (model_id,)).fetchone()[0]
