-- Each document's and observed file's bucket as a column: a bucket's statements
-- read the bucket's rows through a btree index instead of hashing every id of
-- the source (app.document_bucket per row), and the whole range reads it
-- instead of hashing.
--
-- bucket = app.document_bucket(document_id, app.partition_scheme.buckets), or
-- NULL: not filled yet (no scheme when the row was written, or written before
-- this migration). Statements fall back to the hash for a NULL bucket, so a
-- NULL is never wrong, only slower; the INSERT statements fill it, and a bucket
-- run fills what is left in batches (store/bucket_rows.py fill_buckets). Adding a
-- nullable column without a default rewrites nothing, and the indexes are
-- built over NULLs: this migration holds its locks for well under a second
-- whatever the table holds.
ALTER TABLE app.documents ADD COLUMN bucket smallint;
ALTER TABLE app.source_observations ADD COLUMN bucket smallint;
CREATE INDEX documents_source_bucket ON app.documents (source_id, bucket);
CREATE INDEX source_observations_root_bucket ON app.source_observations (root, bucket);

-- The stored buckets hold for one bucket count: when the scheme row changes or
-- goes, they are cleared (NULL: the statements hash again until refilled).
CREATE FUNCTION app.clear_buckets() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE app.documents SET bucket = NULL WHERE bucket IS NOT NULL;
    UPDATE app.source_observations SET bucket = NULL WHERE bucket IS NOT NULL;
    RETURN NULL;
END $$;
CREATE TRIGGER partition_scheme_changed AFTER UPDATE OR DELETE OR TRUNCATE ON app.partition_scheme
FOR EACH STATEMENT EXECUTE FUNCTION app.clear_buckets();

-- What is left to fill, found without reading the filled rows.
CREATE INDEX documents_bucket_unfilled ON app.documents (doc_pk) WHERE bucket IS NULL;
CREATE INDEX source_observations_bucket_unfilled ON app.source_observations (root, document_id)
    WHERE bucket IS NULL;
