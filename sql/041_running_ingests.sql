-- Ingests in progress (pipeline_assets/jobqueue/running_ingests.py): one row per running
-- ingest, kept alive by a beat from its own thread and deleted when the ingest ends.
-- A worker whose queue drains builds the vector index only when no row is alive:
-- an index built while an ingest still inserts is maintained by every later insert,
-- far slower than one build after them. A killed ingest's row stops beating and
-- counts for nothing once past alive_until. Plain rows (no session lock), so the
-- check works across hosts and through a transaction-pooling PgBouncer.
CREATE TABLE app.running_ingests (
    ingest_id   uuid PRIMARY KEY,
    host        text NOT NULL,
    pid         int NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    alive_until timestamptz NOT NULL      -- not running once past this without a new beat
);
