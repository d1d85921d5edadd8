-- Throttles per job, input isolation only after input-specific errors, and the
-- owner of the half-open breaker's probe slot.
--
-- throttles: 429s the job met. A throttle uses no attempt, so without a count a
--   request the provider never accepts (larger than the account's tokens per
--   minute, a gateway's budget) would be claimed first and re-trip the breaker
--   forever. Past a few, the job's requests shrink; a single input throttled
--   past PIPELINE_MAX_THROTTLES is dead-lettered (throttled_too_often).
-- isolate: set only when a batch holding the job was refused for a bad input
--   (400/413/422) and split; such a job goes alone in its next request. Other
--   failures (5xx, timeouts, crashes) isolate nobody.
-- probe_owner: the lease owner of the claim that holds the probe slot, so the
--   slot is released as soon as that claim fails, finds nothing or ends.
-- All three are constant defaults: no table rewrite.
ALTER TABLE app.embedding_jobs
    ADD COLUMN throttles int NOT NULL DEFAULT 0,
    ADD COLUMN isolate   boolean NOT NULL DEFAULT false;

ALTER TABLE app.provider_state
    ADD COLUMN probe_owner text;
