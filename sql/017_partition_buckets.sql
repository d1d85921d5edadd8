-- Document buckets: the Dagster partitions. Documents, chunks and
-- embeddings are partitioned by a fixed set of buckets, not one partition per
-- document: Dagster keeps tens of partitions whatever the corpus size.
--
-- app.partition_scheme has at most one row: the bucket count, written by the
-- first Dagster use of this database (PIPELINE_PARTITION_BUCKETS then) and
-- never changed, so a document stays in its bucket across edits and restarts.
CREATE TABLE app.partition_scheme (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    buckets    integer NOT NULL CHECK (buckets BETWEEN 1 AND 4096),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- A document's bucket: the first 60 bits of sha256(document_id) modulo the
-- count. pipeline_assets/app/buckets.py computes the same in Python
-- (test_buckets checks that the two agree).
CREATE FUNCTION app.document_bucket(document_id text, buckets integer) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN (('x' || left(encode(sha256(convert_to(document_id, 'UTF8')), 'hex'), 15))::bit(60)::bigint
        % buckets)::integer;

-- The checksum of each observed file as last brought current by a bucket run
-- (app/buckets.py sync): a run re-ingests only files whose observed checksum
-- differs from it, so a no-op backfill reads no file and extracts nothing.
ALTER TABLE app.source_observations ADD COLUMN synced text;

-- Upgrading from the per-document scheme: files whose observed bytes are the
-- current document's count as synced, so the first bucket run after the
-- upgrade reads and re-ingests nothing that did not change.
UPDATE app.source_observations o
SET synced = o.checksum
FROM app.documents d
JOIN app.sources s ON s.source_id = d.source_id
WHERE s.root = o.root AND d.document_id = o.document_id AND d.status <> 'deleted'
  AND o.checksum IS NOT NULL AND left(encode(d.source_checksum, 'hex'), 16) = o.checksum;
