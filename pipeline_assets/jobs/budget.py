"""Token budgets: stop claiming once a run's or a day's spend reaches a limit.

Worker threads ask ``exceeded`` before every claim (no I/O: the day's spend by
other workers is refreshed by the worker's main loop). The overshoot is bounded
by the requests already in flight.
"""

from __future__ import annotations

import psycopg

from pipeline_assets.jobs import ledger
from pipeline_assets import settings


class TokenBudget:
    def __init__(self, model_id: str, *, per_run: int, daily: int) -> None:
        self.model_id = model_id
        self.per_run = per_run
        self.daily = daily
        self._others_today: int | None = None  # tokens billed today, not by this process

    @classmethod
    def from_env(cls, model_id: str) -> "TokenBudget":
        return cls(model_id,
                   per_run=settings.env_int("PIPELINE_RUN_TOKEN_BUDGET", settings.DEFAULT_RUN_TOKEN_BUDGET),
                   daily=settings.env_int("PIPELINE_DAILY_TOKEN_BUDGET", settings.DEFAULT_DAILY_TOKEN_BUDGET))

    def refresh(self, conn: psycopg.Connection, run_tokens: int) -> None:
        """Re-read what the model spent today (all workers)."""
        if self.daily:
            self._others_today = ledger.tokens_today(conn, self.model_id) - run_tokens

    def exceeded(self, run_tokens: int) -> str | None:
        """Why claiming must stop, or None."""
        if self.per_run and run_tokens >= self.per_run:
            return f"run token budget of {self.per_run} reached ({run_tokens} used); remaining jobs left pending"
        if self.daily and self._others_today is not None:
            used = self._others_today + run_tokens
            if used >= self.daily:
                return (f"daily token budget of {self.daily} reached ({used} used today, UTC); "
                        "remaining jobs left pending")
        return None
