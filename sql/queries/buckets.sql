-- Document buckets, the Dagster partitions (pipeline_assets/app/buckets.py,
-- migration 017): the stored bucket count and what a bucket run must redo.

-- name: stored_buckets
SELECT buckets FROM app.partition_scheme

-- name: store_buckets
-- The first use of a database fixes its bucket count; later ones read it.
INSERT INTO app.partition_scheme (buckets) VALUES (%(buckets)s)
ON CONFLICT (singleton) DO NOTHING

-- name: unsynced
-- Files of some buckets whose observed bytes a bucket run has not brought
-- current yet (new, changed, or never synced), and gone files (checksum NULL).
SELECT document_id, checksum
FROM app.source_observations
WHERE root = %(root)s
  AND app.document_bucket(document_id, %(n)s) = ANY(%(buckets)s)
  AND (checksum IS NULL OR checksum IS DISTINCT FROM synced)
ORDER BY document_id COLLATE "C"

-- name: unobserved_current
-- Documents of the source in some buckets that are not quarantined or deleted
-- but have no observed file: their files left before any scan saw them.
SELECT d.document_id
FROM app.documents d
JOIN app.sources s ON s.source_id = d.source_id
WHERE s.root = %(root)s AND d.status <> 'deleted'
  AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s)
  AND NOT EXISTS (SELECT 1 FROM app.source_observations o
                  WHERE o.root = s.root AND o.document_id = d.document_id AND o.checksum IS NOT NULL)

-- name: mark_synced
-- The files a bucket run brought current, at the checksum it saw.
UPDATE app.source_observations o
SET synced = r.checksum
FROM unnest(%(ids)s::text[], %(checksums)s::text[]) AS r(document_id, checksum)
WHERE o.root = %(root)s AND o.document_id = r.document_id

-- name: bucket_documents
-- The documents of the source in some buckets that are not deleted, by id.
SELECT d.document_id
FROM app.documents d
JOIN app.sources s ON s.source_id = d.source_id
WHERE s.root = %(root)s AND d.status <> 'deleted'
  AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s)
ORDER BY d.document_id COLLATE "C"
