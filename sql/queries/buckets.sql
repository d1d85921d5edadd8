-- Document buckets, the Dagster partitions (pipeline_assets/store/bucket_rows.py; the hash: app/buckets.py;
-- migration 017): the stored bucket count and what a bucket run must redo.

-- name: stored_buckets
-- The bucket count the partitions were made with.
SELECT buckets FROM app.partition_scheme

-- name: store_buckets
-- The first use of a database fixes its bucket count; later ones read it.
INSERT INTO app.partition_scheme (buckets) VALUES (%(buckets)s)
ON CONFLICT (singleton) DO NOTHING

-- name: unsynced
-- Files of some buckets a bucket run has not brought current yet (new, changed, never synced) and
-- gone ones (checksum NULL); ``in_store``: the bytes are already the document's (only recorded).
-- One keyset page: the first %(limit)s after %(after)s in primary-key order.
SELECT o.document_id, o.checksum,
       EXISTS (SELECT 1 FROM app.documents d JOIN app.sources s ON s.source_id = d.source_id
               WHERE s.root = o.root AND d.document_id = o.document_id AND d.status <> 'deleted'
                 AND left(encode(d.source_checksum, 'hex'), 16) = o.checksum) AS in_store
FROM app.source_observations o
WHERE o.root = %(root)s
  AND (%(buckets)s::int[] IS NULL OR (o.bucket = ANY(%(buckets)s::int[]) OR o.bucket IS NULL AND app.document_bucket(o.document_id, %(n)s) = ANY(%(buckets)s::int[])))
  AND (o.checksum IS NULL OR o.checksum IS DISTINCT FROM o.synced)
  AND o.document_id > %(after)s
ORDER BY o.document_id
LIMIT %(limit)s

-- name: live_versions
-- The distinct (extractor version, chunker version, extension) of a source's live documents, as
-- rerun_targets reads them ('' for none): a skip scan of documents_live_versions, one index
-- descent per combination, whatever the source holds.
WITH RECURSIVE v AS (
    (SELECT coalesce(d.extractor_version, '') AS e, coalesce(d.chunker_version, '') AS c,
            coalesce(lower(substring(d.document_id FROM '[^/](\.[^./]+)$')), '') AS x
     FROM app.documents d
     WHERE d.source_id = (SELECT source_id FROM app.sources WHERE root = %(root)s) AND d.status <> 'deleted'
     ORDER BY 1, 2, 3
     LIMIT 1)
    UNION ALL
    SELECT nxt.e, nxt.c, nxt.x
    FROM v, LATERAL (
        SELECT coalesce(d.extractor_version, '') AS e, coalesce(d.chunker_version, '') AS c,
               coalesce(lower(substring(d.document_id FROM '[^/](\.[^./]+)$')), '') AS x
        FROM app.documents d
        WHERE d.source_id = (SELECT source_id FROM app.sources WHERE root = %(root)s) AND d.status <> 'deleted'
          AND (coalesce(d.extractor_version, ''), coalesce(d.chunker_version, ''),
               coalesce(lower(substring(d.document_id FROM '[^/](\.[^./]+)$')), '')) > (v.e, v.c, v.x)
        ORDER BY 1, 2, 3
        LIMIT 1) nxt
)
SELECT e, c, x FROM v

-- name: unobserved_current
-- Live documents of the source in some buckets without an observed file (their files left before any
-- scan saw them): the two indexes documents_live_bucket and source_observations_present merged by
-- (bucket, id), no row read; what is left is checked by id (an observation without a bucket yet).
SELECT c.document_id
FROM (SELECT d.document_id
      FROM app.documents d
      WHERE d.source_id = (SELECT source_id FROM app.sources WHERE root = %(root)s) AND d.status <> 'deleted'
        AND (%(buckets)s::int[] IS NULL OR d.bucket = ANY(%(buckets)s::int[]))
        AND NOT EXISTS (SELECT 1 FROM app.source_observations o
                        WHERE o.root = %(root)s AND o.bucket = d.bucket AND o.document_id = d.document_id
                          AND (%(buckets)s::int[] IS NULL OR o.bucket = ANY(%(buckets)s::int[]))
                          AND o.checksum IS NOT NULL)
      UNION ALL
      SELECT d.document_id
      FROM app.documents d
      WHERE d.bucket IS NULL AND %(buckets)s::int[] IS NOT NULL
        AND d.source_id = (SELECT source_id FROM app.sources WHERE root = %(root)s) AND d.status <> 'deleted'
        AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s::int[])) c
WHERE NOT EXISTS (SELECT 1 FROM app.source_observations o
                  WHERE o.root = %(root)s AND o.document_id = c.document_id AND o.checksum IS NOT NULL)

-- name: mark_synced
-- The files a bucket run brought current, at the checksum it saw.
UPDATE app.source_observations o
SET synced = r.checksum
FROM unnest(%(ids)s::text[], %(checksums)s::text[]) AS r(document_id, checksum)
WHERE o.root = %(root)s AND o.document_id = r.document_id

-- name: resolve_unread
-- Files a scan listed unread (placeholder checksum), now ingested: their checksum becomes that of
-- the bytes the ingest read, synced; a row changed meanwhile or a document without one is kept.
UPDATE app.source_observations o
SET checksum = left(encode(d.source_checksum, 'hex'), 16), synced = left(encode(d.source_checksum, 'hex'), 16)
FROM unnest(%(ids)s::text[], %(checksums)s::text[]) AS r(document_id, checksum),
     app.documents d JOIN app.sources s ON s.source_id = d.source_id
WHERE o.root = %(root)s AND o.document_id = r.document_id AND o.checksum = r.checksum
  AND s.root = o.root AND d.document_id = o.document_id AND d.status <> 'deleted'
  AND d.source_checksum IS NOT NULL

-- name: bucket_states
-- Per bucket (of %(n)s) with documents not deleted: counts, the first %(sample)s quarantined ids and
-- two sha256 digests over "document_id=value" by id in byte order (value: the text checksum, or
-- status:error_class without text; the chunk digest). A test pins it against a Python computation.
WITH docs AS (
    SELECT d.doc_pk, d.document_id, d.status, d.text_checksum, d.error_class,
           coalesce(d.bucket, app.document_bucket(d.document_id, %(n)s)) AS bucket
    FROM app.documents d
    JOIN app.sources s ON s.source_id = d.source_id
    WHERE s.root = %(root)s AND d.status <> 'deleted'
      AND (%(buckets)s::int[] IS NULL OR (d.bucket = ANY(%(buckets)s::int[]) OR d.bucket IS NULL AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s::int[])))
), per_doc AS (
    SELECT docs.bucket, docs.document_id, docs.status,
           coalesce(encode(docs.text_checksum, 'hex'), docs.status || ':' || coalesce(docs.error_class, 'None'))
               AS text_value,
           count(c.chunk_index) AS chunks,
           coalesce(sum(c.token_count), 0) AS tokens,
           encode(sha256(coalesce(string_agg(c.chunk_checksum, ''::bytea ORDER BY c.chunk_index), ''::bytea)),
                  'hex') AS chunks_digest
    FROM docs
    LEFT JOIN app.chunks c ON c.doc_pk = docs.doc_pk
    GROUP BY docs.doc_pk, docs.bucket, docs.document_id, docs.status, docs.text_checksum, docs.error_class
)
SELECT bucket,
       count(*) AS documents,
       count(*) FILTER (WHERE status = 'current') AS current,
       count(*) FILTER (WHERE status = 'quarantined') AS quarantined,
       sum(chunks) AS chunks,
       sum(tokens) AS tokens,
       encode(sha256(string_agg(convert_to(document_id || '=' || text_value, 'UTF8') || '\x1e'::bytea, ''::bytea
                                ORDER BY document_id COLLATE "C")), 'hex') AS text_digest,
       encode(sha256(string_agg(convert_to(document_id || '=' || chunks_digest, 'UTF8') || '\x1e'::bytea, ''::bytea
                                ORDER BY document_id COLLATE "C")), 'hex') AS chunks_digest,
       coalesce((array_agg(document_id ORDER BY document_id COLLATE "C")
                 FILTER (WHERE status = 'quarantined'))[1:%(sample)s], ARRAY[]::text[]) AS quarantined_ids
FROM per_doc
GROUP BY bucket

-- name: source_documents
-- The source's documents that are not deleted (all buckets).
SELECT count(*) FROM app.documents d JOIN app.sources s ON s.source_id = d.source_id
WHERE s.root = %(root)s AND d.status <> 'deleted'

-- name: bucket_current_pks
-- The source's current documents in some buckets (of %(n)s): their keys.
SELECT d.doc_pk
FROM app.documents d
JOIN app.sources s ON s.source_id = d.source_id
WHERE s.root = %(root)s AND d.status = 'current'
  AND (%(buckets)s::int[] IS NULL OR (d.bucket = ANY(%(buckets)s::int[]) OR d.bucket IS NULL AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s::int[])))

-- name: bucket_coverage
-- Per bucket (of %(n)s) of current documents: chunks for one model, how many ready, failed or
-- waiting, and the first %(sample)s documents with a failed chunk; plus the total row (bucket NULL,
-- always there) counting distinct chunk checksums, as store/reports.py embedding_coverage does.
WITH docs AS (
    SELECT d.doc_pk, d.document_id, coalesce(d.bucket, app.document_bucket(d.document_id, %(n)s)) AS bucket
    FROM app.documents d
    JOIN app.sources s ON s.source_id = d.source_id
    WHERE s.root = %(root)s AND d.status = 'current'
      AND (%(buckets)s::int[] IS NULL OR (d.bucket = ANY(%(buckets)s::int[]) OR d.bucket IS NULL AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s::int[])))
), chunk_state AS (
    SELECT docs.bucket, docs.document_id, c.chunk_checksum,
           coalesce(j.status = 'ready' AND e.chunk_checksum IS NOT NULL, false) AS ready,
           coalesce(j.status = 'failed', false) AS failed,
           (j.job_id IS NULL OR j.status IN ('pending', 'retry', 'processing')) AS waiting
    FROM docs
    JOIN app.chunks c ON c.doc_pk = docs.doc_pk
    LEFT JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum AND k.model_id = %(model)s
    LEFT JOIN app.embedding_jobs j ON j.job_id = k.job_id
    LEFT JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %(model)s
)
SELECT bucket,
       CASE WHEN GROUPING(bucket) = 0 THEN count(DISTINCT (document_id, chunk_checksum))
            ELSE count(DISTINCT chunk_checksum) END AS chunks,
       CASE WHEN GROUPING(bucket) = 0 THEN count(DISTINCT (document_id, chunk_checksum)) FILTER (WHERE ready)
            ELSE count(DISTINCT chunk_checksum) FILTER (WHERE ready) END AS ready,
       CASE WHEN GROUPING(bucket) = 0 THEN count(DISTINCT (document_id, chunk_checksum)) FILTER (WHERE failed)
            ELSE count(DISTINCT chunk_checksum) FILTER (WHERE failed) END AS failed,
       CASE WHEN GROUPING(bucket) = 0 THEN count(DISTINCT (document_id, chunk_checksum)) FILTER (WHERE waiting)
            ELSE count(DISTINCT chunk_checksum) FILTER (WHERE waiting) END AS waiting,
       coalesce((array_agg(DISTINCT document_id) FILTER (WHERE failed))[1:%(sample)s], ARRAY[]::text[]) AS failed_ids
FROM chunk_state
GROUP BY GROUPING SETS ((bucket), ())

-- name: fill_document_buckets
-- Up to %(limit)s documents without a stored bucket get the scheme's (none: no
-- scheme yet); rows another transaction holds are left to it. Returns the count.
WITH batch AS (
    SELECT doc_pk FROM app.documents WHERE bucket IS NULL LIMIT %(limit)s FOR UPDATE SKIP LOCKED
), filled AS (
    UPDATE app.documents d SET bucket = app.document_bucket(d.document_id, p.buckets)
    FROM batch, app.partition_scheme p
    WHERE d.doc_pk = batch.doc_pk
    RETURNING 1
)
SELECT count(*) FROM filled

-- name: fill_observation_buckets
-- The same for observed files.
WITH batch AS (
    SELECT root, document_id FROM app.source_observations WHERE bucket IS NULL LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), filled AS (
    UPDATE app.source_observations o SET bucket = app.document_bucket(o.document_id, p.buckets)
    FROM batch, app.partition_scheme p
    WHERE o.root = batch.root AND o.document_id = batch.document_id
    RETURNING 1
)
SELECT count(*) FROM filled

-- name: analyze_buckets
-- The stored buckets' statistics after a fill: until then the planner takes the
-- filled rows for unfilled ones (NULL) and reads every row of the source.
ANALYZE app.documents (bucket), app.source_observations (bucket)
