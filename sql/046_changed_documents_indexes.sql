-- What the source sensor's run after an edit reads, found by an index instead of
-- by reading every document of its buckets (app/buckets.py sync_buckets):
--
-- 1. The observed files a bucket run has not brought current (new, changed,
--    gone: the statements' "unsynced" predicate). A handful after an edit,
--    whatever the corpus holds; the sensor's pending_buckets reads the same.
CREATE INDEX source_observations_unsynced ON app.source_observations (root, document_id)
    WHERE checksum IS NULL OR checksum IS DISTINCT FROM synced;

-- 2. Each live document's extractor and chunker versions with its extension
--    (as rerun_targets reads it), per source: a skip scan of it lists the
--    few distinct combinations in a few index descents, so a run knows
--    without reading the documents whether any is stale (another version than
--    the current one). Only write_documents writes these columns, with the
--    extract and chunk rows of app.stage_runs that carry the same versions.
CREATE INDEX documents_live_versions ON app.documents (
    source_id,
    coalesce(extractor_version, ''),
    coalesce(chunker_version, ''),
    coalesce(lower(substring(document_id FROM '[^/](\.[^./]+)$')), '')
) WHERE status <> 'deleted';

-- 3. Each live document by bucket and id: documents without an observed file
--    are found by comparing two indexes, without visiting the documents' rows.
CREATE INDEX documents_live_bucket ON app.documents (source_id, bucket, document_id)
    WHERE status <> 'deleted';
CREATE INDEX source_observations_present ON app.source_observations (root, document_id)
    WHERE checksum IS NOT NULL;
