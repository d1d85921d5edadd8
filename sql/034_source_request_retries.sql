-- The source sensor requests a file again when the run it requested ended
-- (failed, cancelled, or never launched) without syncing it, after a backoff
-- that grows with the requests of the same bytes (app/observations.py,
-- RETRY_BASE_SECONDS doubling up to RETRY_CAP_SECONDS):
--   request_attempts  requests of the current checksum (or of the file's
--                     absence) so far; 1 after the first;
--   retry_at          when a tick may request it again: set by the first tick
--                     with none of the sensor's runs in flight that finds the
--                     request ended unsynced; NULL while requested or synced.
ALTER TABLE app.source_observations
    ADD COLUMN request_attempts int NOT NULL DEFAULT 0,
    ADD COLUMN retry_at timestamptz;
