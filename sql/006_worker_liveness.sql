-- Worker liveness (pipeline_assets/jobqueue/leases.py): one row per running worker
-- (one Worker in a process), refreshed every second or so by its own thread on
-- its own connection. Its lease owners all start with owner_prefix
-- (`worker-id/uuid/`), so the claims of a worker that stopped beating (killed,
-- frozen, cut off) are rescued within a few seconds instead of a whole lease,
-- while a live worker's slow call keeps its lease.
CREATE TABLE app.workers (
    owner_prefix text PRIMARY KEY,          -- every lease owner of this worker starts with it
    worker_id    text NOT NULL,             -- `--worker-id`, default host:pid
    model_id     text NOT NULL,
    host         text NOT NULL,
    pid          int NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    alive_since  timestamptz NOT NULL DEFAULT now(),  -- beating without a gap since
    beat_at      timestamptz NOT NULL DEFAULT now(),
    alive_until  timestamptz NOT NULL      -- dead once past this without a new beat
);
