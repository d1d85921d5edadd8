-- A bucket run (app/buckets.py) reads its own buckets' documents and
-- observations through an index on the bucket expression, instead of hashing
-- every document id of the source in each query: its cost follows what its
-- buckets hold, not the corpus. app.document_bucket is IMMUTABLE and the
-- queries pass the count as a parameter, which the planner folds into each
-- (custom) plan, so these match when the database's bucket count is the
-- default, 64 (DEFAULT_PARTITION_BUCKETS in settings.py); with another count
-- the queries hash every row, as before.
CREATE INDEX documents_bucket_64 ON app.documents (app.document_bucket(document_id, 64));
CREATE INDEX source_observations_bucket_64
    ON app.source_observations (root, app.document_bucket(document_id, 64), document_id);
