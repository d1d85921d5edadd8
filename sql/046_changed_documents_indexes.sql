-- What the source sensor's run after an edit reads, found by an index instead of
-- by reading every document of its buckets (app/buckets.py sync_buckets):
--
-- 1. The observed files a bucket run has not brought current (new, changed,
--    gone: the statements' "unsynced" predicate, as written there), a handful
--    after an edit whatever the corpus holds. An index on the predicate's value
--    rather than a partial one: the planner has statistics on an indexed
--    expression (ANALYZE below, then autovacuum's), none on a comparison of two
--    columns, which it would take to hold for most rows and read the buckets'.
CREATE INDEX source_observations_unsynced ON app.source_observations
    (root, (checksum IS NULL OR checksum IS DISTINCT FROM synced), document_id);

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

-- 3. Each live document and each present observed file by bucket and id: the
--    documents without an observed file are found by merging the two, bucket by
--    bucket, without visiting a row of either table.
CREATE INDEX documents_live_bucket ON app.documents (source_id, bucket, document_id)
    WHERE status <> 'deleted';
CREATE INDEX source_observations_present ON app.source_observations (root, bucket, document_id)
    WHERE checksum IS NOT NULL;

ANALYZE app.source_observations;
