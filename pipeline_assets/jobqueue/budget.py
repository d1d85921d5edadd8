"""Token budgets: stop claiming once a run's or a day's spend reaches a limit.

Worker threads ask ``exceeded`` before every claim (no I/O: the day's spend by
other workers is refreshed by the worker's main loop). The overshoot is bounded
by the requests already in flight.
"""

from __future__ import annotations


class TokenBudget:
    def __init__(self, model_id: str, *, per_run: int, daily: int) -> None:
        self.model_id = model_id
        self.per_run = per_run
        self.daily = daily
        self._others_today: int | None = None  # tokens billed today, not by this process

    def refresh(self, tokens_today: int, run_tokens: int) -> None:
        """Take in what the model spent today (all workers: ``ledger.tokens_today``)."""
        if self.daily:
            self._others_today = tokens_today - run_tokens

    def exceeded(self, run_tokens: int) -> str | None:
        """Why claiming must stop, or None."""
        if self.per_run and run_tokens >= self.per_run:
            return f"run token budget of {self.per_run} reached ({run_tokens} used); remaining jobs left pending"
        if self.daily and self._others_today is not None:
            used = self._others_today + run_tokens
            if used >= self.daily:
                return (
                    f"daily token budget of {self.daily} reached ({used} used today, UTC); remaining jobs left pending"
                )
        return None
