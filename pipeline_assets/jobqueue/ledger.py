"""The spend ledger: every provider call, and how often each input was sent.

A send is recorded before the request goes out, in its own short transaction
(``record_send``): the call row starts ``sent``, possibly billed, with its inputs' estimated
tokens and checksums (counted by the view ``app.input_sends``). ``record_outcome`` settles it:
an answer is billed with the provider's usage; an ambiguous failure (timeout, dropped
connection) stays possibly billed at the estimate; a refusal (429, 5xx, 4xx) was not billed.
So a send whose answer never came is still counted, and inputs sent more than once for the
same content and model are exactly the duplicate spend ``status`` reports.
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg

from pipeline_assets.store import arrays, queries

LEDGER = queries.load("ledger")

# billed: what the ledger knows of a call's cost.
BILLED, MAYBE_BILLED, NOT_BILLED = "yes", "maybe", "no"


def record_send(
    conn: psycopg.Connection,
    *,
    model_id: str,
    worker_id: str,
    checksums: Sequence[bytes],
    tokens: int,
    worker_run: str | None = None,
) -> int:
    """Count a send before it goes out: one statement in its own transaction,
    committed (without waiting for its WAL flush) when this returns; returns the
    call id. (Inside a caller's transaction it commits with that one, which
    then does not wait for its flush either.)"""
    return queries.scalar(
        conn,
        LEDGER.record_send,
        {
            "model": model_id,
            "worker": worker_id,
            "worker_run": worker_run,
            "tokens": tokens,
            "checksums": arrays.bytea(conn, checksums),
        },
    )


def record_outcome(
    conn: psycopg.Connection,
    *,
    call_id: int,
    outcome: str,
    status: int | None,
    latency: float,
    billed: str,
    tokens: int | None = None,
) -> None:
    """Settle a recorded send (once; a second outcome for the same call changes nothing).
    ``tokens`` None keeps the estimate recorded with the send. A refusal
    (``NOT_BILLED``) takes the call's sends back: only billed or possibly billed calls count."""
    conn.execute(
        LEDGER.record_outcome,
        {
            "call": call_id,
            "outcome": outcome,
            "status": status,
            "latency": int(latency * 1000),
            "billed": billed,
            "tokens": tokens,
        },
    )


def record_call(
    conn: psycopg.Connection,
    *,
    model_id: str,
    worker_id: str,
    jobs: Sequence,
    tokens: int,
    outcome: str,
    status: int | None,
    latency: float,
    billed: bool,
) -> None:
    """Record a call after the fact, in one statement (callers that send nothing
    worth counting beforehand)."""
    conn.execute(
        LEDGER.record_call,
        {
            "model": model_id,
            "worker": worker_id,
            "tokens": tokens,
            "outcome": outcome,
            "status": status,
            "latency": int(latency * 1000),
            "checksums": [j.chunk_checksum for j in jobs],
            "billed": billed,
        },
    )


def tokens_today(conn: psycopg.Connection, model_id: str, *, excluding_run: str | None = None) -> int:
    """Tokens billed (or possibly billed) for the model since midnight UTC, except
    those sent by the worker run ``excluding_run`` (``worker_run`` of ``record_send``)."""
    return queries.scalar(conn, LEDGER.tokens_today, {"model": model_id, "worker_run": excluding_run})
