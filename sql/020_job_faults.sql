-- Transient faults per job, charged to the request instead of the inputs.
--
-- faults: transient provider faults (5xx, timeout, dropped connection) the job
--   met in requests that cost it no attempt. A transient failure is the
--   provider's or the request's, not each input's: it is counted here, and a
--   job's requests shrink with it (decisions.fault_cap), so inputs that keep
--   failing together are split up. Only once a job has met
--   decisions.FREE_FAULTS of them and fails again alone is an attempt charged,
--   so an input is dead-lettered for transient faults only when it keeps
--   failing alone. Reset with the attempts (requeue, revive).
-- A constant default: no table rewrite.
ALTER TABLE app.embedding_jobs
    ADD COLUMN faults int NOT NULL DEFAULT 0;
