-- Circuit breaker on the shared provider state. A 429 (or BREAKER_THRESHOLD
-- consecutive 5xx/connection failures) trips it: every worker stops claiming
-- until paused_until; then it is half-open: one claim at a time (probe_until)
-- probes the provider, and the first success closes it again.
ALTER TABLE app.provider_state
    ADD COLUMN tripped     boolean NOT NULL DEFAULT false,
    ADD COLUMN probe_until timestamptz NOT NULL DEFAULT '-infinity';

-- Daily token budgets sum the ledger by model and time.
CREATE INDEX provider_calls_model_time ON app.provider_calls (model_id, called_at);
