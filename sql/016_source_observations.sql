-- The source sensor's observations (pipeline_assets/app/observations.py,
-- sql/queries/observations.sql): what the `source_documents` Dagster sensor last
-- saw of each file of a source, and what it last put into a run request.
--
-- Before, the sensor's cursor was the whole {document: checksum} map, written
-- into every tick row of Dagster's storage (about 4 MB at 100,000 documents);
-- now the cursor holds only the sensor's generation. size and mtime_ns are the
-- prefilter: a file whose (size, mtime_ns) equal the stored ones is not read
-- again, so an unchanged tick after a code reload hashes nothing. A file
-- modified less than two seconds before its scan is stored with mtime_ns = 0
-- (its mtime granule may still change under the same size and mtime): it is
-- read once more on the next tick.
--
-- A row is pending (the next tick requests it) while its checksum differs from
-- the one last requested, or while it was requested by a tick whose cursor
-- Dagster did not save (requested_gen >= the cursor's generation: the replay
-- asks for the same run keys, so Dagster launches nothing twice). A gone file
-- (checksum NULL) stays until a tombstone run has tombstoned its document and
-- deleted the row.
CREATE TABLE app.source_observations (
    root          text NOT NULL,      -- the source root, absolute and resolved
    document_id   text NOT NULL,      -- path relative to the root: the Dagster partition key
    checksum      text,               -- 16 hex digits of the bytes' sha256; NULL: the file is gone
    size          bigint NOT NULL,    -- st_size when checksum was computed (prefilter)
    mtime_ns      bigint NOT NULL,    -- st_mtime_ns when checksum was computed; 0: read it again
    requested     text,               -- the checksum last put into a run request; NULL: none yet (or a tombstone)
    requested_gen bigint,             -- the sensor generation of that request; NULL: never requested
    observed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (root, document_id)
);
