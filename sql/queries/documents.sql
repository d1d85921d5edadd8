-- The document table family: app.sources, app.documents, app.chunks, and the
-- extract/chunk rows of app.stage_runs that ingest writes with them.
-- Used by pipeline_assets/store/documents.py.

-- name: write_lock
-- Serialise transactions that replace chunks (see documents.write_lock).
SELECT pg_advisory_xact_lock(%(key)s)

-- name: register_source
-- A source's id by its root, registered on first sight.
INSERT INTO app.sources (root, kind) VALUES (%(root)s, %(kind)s)
ON CONFLICT (root) DO UPDATE SET root = EXCLUDED.root
RETURNING source_id

-- name: sources
-- Every registered source root, oldest first.
SELECT root FROM app.sources ORDER BY source_id

-- name: mark_scanned
-- Record that a source's complete scan ended now.
UPDATE app.sources SET last_scan_at = now() WHERE source_id = %(source)s

-- name: db_now
-- The database clock (what stage rows and scans are compared with).
SELECT now()

-- name: create_seen
-- Document ids a full scan listed (a session-local temp table).
CREATE TEMP TABLE IF NOT EXISTS ingest_seen (document_id text PRIMARY KEY)

-- name: truncate_seen
-- Empty this session's list of the ids a scan has seen.
TRUNCATE ingest_seen

-- name: insert_seen
-- Add ids a scan has seen to this session's list (a statement, not a COPY: it is pipelined).
INSERT INTO ingest_seen (document_id) SELECT unnest(%(ids)s::text[])

-- name: current_count
-- A source's documents not deleted (the empty-listing guard compares with it).
SELECT count(*) FROM app.documents WHERE source_id = %(source)s AND status <> 'deleted'

-- name: has_documents
-- Whether a source has any document row (any status): an ingest of a source without one looks nothing up.
SELECT EXISTS (SELECT 1 FROM app.documents WHERE source_id = %(source)s)

-- name: existing
-- What ingest knows of some documents, to skip the unchanged ones.
SELECT document_id, source_checksum, extractor_version, chunker_version, status, error_class, size_bytes,
       source_token
FROM app.documents WHERE source_id = %(source)s AND document_id = ANY(%(ids)s)

-- name: tombstone_unseen
-- Documents of a source that a complete scan did not list. Only what this scan
-- could have seen: a document another process ingested after the listing
-- started (updated_at >= scan start) is not "gone".
UPDATE app.documents d SET status = 'deleted', chunk_count = 0, updated_at = now()
WHERE d.source_id = %(source)s AND d.status <> 'deleted' AND d.updated_at < %(scan_started)s
  AND NOT EXISTS (SELECT 1 FROM ingest_seen s WHERE s.document_id = d.document_id)
RETURNING d.doc_pk

-- name: tombstone_ids
-- Named documents of a source whose file is gone.
UPDATE app.documents d SET status = 'deleted', chunk_count = 0, updated_at = now()
WHERE d.source_id = %(source)s AND d.status <> 'deleted' AND d.document_id = ANY(%(ids)s)
RETURNING d.doc_pk

-- name: delete_chunks
-- Drop documents' chunks before their new ones; returns the checksums they had.
DELETE FROM app.chunks WHERE doc_pk = ANY(%(pks)s) RETURNING chunk_checksum

-- name: write_documents
-- Processed documents upserted (current, or quarantined with its error), their old chunks deleted and their
-- extract and chunk stage rows written. Rows: (document_id, doc_pk, NULL) per document, then (NULL, NULL,
-- checksum) per chunk deleted.
WITH up AS (
    INSERT INTO app.documents AS d (source_id, document_id, source_uri, source_checksum, size_bytes, status,
                                    extractor_version, chunker_version, text_checksum, chunk_count,
                                    error_class, error_message, source_token, bucket)
    SELECT %(source)s, t.document_id, t.uri, t.checksum, t.size,
           CASE WHEN t.error_class IS NULL THEN 'current' ELSE 'quarantined' END,
           t.ext, %(chunker)s, t.text_checksum, t.chunk_count, t.error_class, t.error_message, t.token,
           app.document_bucket(t.document_id, (SELECT buckets FROM app.partition_scheme))
    FROM unnest(%(ids)s::text[], %(uris)s::text[], %(checksums)s::bytea[], %(sizes)s::bigint[],
                %(text_checksums)s::bytea[], %(counts)s::int[], %(classes)s::text[], %(messages)s::text[],
                %(exts)s::text[], %(tokens)s::text[])
         AS t(document_id, uri, checksum, size, text_checksum, chunk_count, error_class, error_message, ext, token)
    ON CONFLICT (source_id, document_id) DO UPDATE
    SET source_uri = EXCLUDED.source_uri, source_checksum = EXCLUDED.source_checksum,
        size_bytes = EXCLUDED.size_bytes, status = EXCLUDED.status, source_token = EXCLUDED.source_token,
        extractor_version = EXCLUDED.extractor_version, chunker_version = EXCLUDED.chunker_version,
        text_checksum = EXCLUDED.text_checksum, chunk_count = EXCLUDED.chunk_count,
        error_class = EXCLUDED.error_class, error_message = EXCLUDED.error_message, updated_at = now()
    RETURNING d.document_id, d.doc_pk, d.source_checksum, d.extractor_version, d.error_class, d.error_message
), old AS (
    -- The keys as an array: an index scan of app.chunks whatever its statistics say.
    DELETE FROM app.chunks WHERE doc_pk = ANY (ARRAY(SELECT doc_pk FROM up)) RETURNING chunk_checksum
), stages AS (
    INSERT INTO app.stage_runs AS s (doc_pk, stage, status, error_class, last_error, code_version,
                                     config_hash, dagster_run_id, source_checksum, finished_at)
    SELECT up.doc_pk, g.stage,
           CASE WHEN up.error_class IS NULL THEN 'succeeded' WHEN g.stage = 'extract' THEN 'failed' ELSE 'skipped' END,
           CASE WHEN g.stage = 'extract' THEN up.error_class END,
           CASE WHEN g.stage = 'extract' THEN up.error_message END,
           CASE WHEN g.stage = 'extract' THEN up.extractor_version ELSE %(chunker)s END,
           %(config)s, %(run)s, up.source_checksum, now()
    FROM up CROSS JOIN (VALUES ('extract'), ('chunk')) AS g(stage)
    ON CONFLICT (doc_pk, stage, model_id) DO UPDATE
    SET status = EXCLUDED.status, error_class = EXCLUDED.error_class, last_error = EXCLUDED.last_error,
        code_version = EXCLUDED.code_version, config_hash = EXCLUDED.config_hash,
        dagster_run_id = EXCLUDED.dagster_run_id, source_checksum = EXCLUDED.source_checksum,
        attempts = s.attempts + 1, started_at = now(), finished_at = now()
)
SELECT document_id, doc_pk, NULL::bytea FROM up
UNION ALL
SELECT NULL, NULL, chunk_checksum FROM old

-- name: copy_chunks
-- Write chunks in one binary COPY.
COPY app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end) FROM STDIN
WITH (FORMAT BINARY)

-- name: touched_since
-- Documents of one source whose row changed since a point of the database
-- clock (a reconciliation's start): new (created since), changed, quarantined
-- or tombstoned. What Dagster is told about after a reconciliation.
SELECT d.document_id, d.status, d.created_at >= %(since)s AS new
FROM app.documents d JOIN app.sources s ON s.source_id = d.source_id
WHERE s.root = %(root)s AND d.updated_at >= %(since)s
ORDER BY d.document_id
