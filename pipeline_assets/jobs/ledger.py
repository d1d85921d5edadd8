"""The spend ledger: every provider call, and how often each input was sent.

An input counts as sent when the provider answered, or when the call's outcome
is ambiguous (timeout, dropped connection: it may have been computed and
billed). Inputs sent more than once for the same content and model are the
duplicate spend that ``status`` reports.
"""

from __future__ import annotations

from typing import Sequence

import psycopg

from pipeline_assets.store import queries

LEDGER = queries.load("ledger")


def record_call(conn: psycopg.Connection, *, model_id: str, worker_id: str, jobs: Sequence, tokens: int,
                outcome: str, status: int | None, latency: float, billed: bool) -> None:
    conn.execute(LEDGER.record_call, {"model": model_id, "worker": worker_id, "tokens": tokens,
                                      "outcome": outcome, "status": status, "latency": int(latency * 1000),
                                      "checksums": [j.chunk_checksum for j in jobs], "billed": billed})


def tokens_today(conn: psycopg.Connection, model_id: str) -> int:
    """Tokens billed for the model since midnight UTC."""
    return conn.execute(LEDGER.tokens_today, {"model": model_id}).fetchone()[0]
