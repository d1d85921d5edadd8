-- The dead-letter queue as a work list (store/dead_letter_rows.py; the use cases: app/dlq.py): failed jobs and quarantined documents by
-- error class, an item's attempts (app.job_attempts), requeue selections and discards.

-- name: groups
-- Per kind and error class: open items (not discarded), discarded ones, and
-- when the open ones failed first and last.
WITH items AS (
    SELECT 'job' AS kind, j.error_class, j.updated_at AS failed_at, dd.job_id IS NOT NULL AS discarded
    FROM app.embedding_jobs j LEFT JOIN app.dlq_discards dd ON dd.job_id = j.job_id
    WHERE j.status = 'failed'
    UNION ALL
    SELECT 'document', d.error_class, d.updated_at, dd.doc_pk IS NOT NULL
    FROM app.documents d LEFT JOIN app.dlq_discards dd ON dd.doc_pk = d.doc_pk
    WHERE d.status = 'quarantined'
)
SELECT kind, error_class,
       count(*) FILTER (WHERE NOT discarded) AS items,
       count(*) FILTER (WHERE discarded) AS discarded,
       min(failed_at) FILTER (WHERE NOT discarded) AS first_seen,
       max(failed_at) FILTER (WHERE NOT discarded) AS last_seen
FROM items GROUP BY kind, error_class
ORDER BY count(*) FILTER (WHERE NOT discarded) DESC, kind, error_class NULLS LAST

-- name: job_items
-- Failed jobs (of one error class when cls is given; the discarded ones when
-- discarded is true, else the open ones), with the documents that (still)
-- carry their content.
SELECT j.job_id, j.model_id, j.error_class, j.error_message, j.attempts, j.updated_at,
       (SELECT array_agg(DISTINCT d.document_id ORDER BY d.document_id)
        FROM app.chunks c JOIN app.documents d ON d.doc_pk = c.doc_pk
        WHERE c.chunk_checksum = j.chunk_checksum) AS documents,
       dd.discarded_by, dd.reason, dd.discarded_at
FROM app.embedding_jobs j LEFT JOIN app.dlq_discards dd ON dd.job_id = j.job_id
WHERE j.status = 'failed'
  AND (%(cls)s::text IS NULL OR j.error_class = %(cls)s::text)
  AND (dd.job_id IS NOT NULL) = %(discarded)s
ORDER BY j.updated_at, j.job_id

-- name: document_items
-- Quarantined documents, filtered like job_items.
SELECT d.doc_pk, d.document_id, src.root, d.error_class, d.error_message, d.updated_at,
       dd.discarded_by, dd.reason, dd.discarded_at
FROM app.documents d JOIN app.sources src USING (source_id)
LEFT JOIN app.dlq_discards dd ON dd.doc_pk = d.doc_pk
WHERE d.status = 'quarantined'
  AND (%(cls)s::text IS NULL OR d.error_class = %(cls)s::text)
  AND (dd.doc_pk IS NOT NULL) = %(discarded)s
ORDER BY d.document_id, src.root

-- name: job
-- One job, whatever its status, for `dlq show`.
SELECT j.job_id, j.model_id, j.status, j.attempts, j.max_attempts, j.throttles, j.error_class,
       j.error_message, j.updated_at, encode(j.chunk_checksum, 'hex') AS chunk_checksum,
       (SELECT array_agg(DISTINCT d.document_id ORDER BY d.document_id)
        FROM app.chunks c JOIN app.documents d ON d.doc_pk = c.doc_pk
        WHERE c.chunk_checksum = j.chunk_checksum) AS documents,
       dd.discarded_by, dd.reason, dd.discarded_at
FROM app.embedding_jobs j LEFT JOIN app.dlq_discards dd ON dd.job_id = j.job_id
WHERE j.job_id = %(id)s

-- name: attempts
-- Every recorded attempt of one job, oldest first (the newest
-- app.job_attempts_kept() are kept).
SELECT attempt_id, recorded_at, actor, attempt, outcome, status, error_class, error_message
FROM app.job_attempts WHERE job_id = %(id)s ORDER BY attempt_id

-- name: documents_named
-- The documents with this id (one per source that has it), for `dlq show`.
SELECT d.doc_pk, d.document_id, src.root, d.status, d.error_class, d.error_message, d.updated_at,
       dd.discarded_by, dd.reason, dd.discarded_at
FROM app.documents d JOIN app.sources src USING (source_id)
LEFT JOIN app.dlq_discards dd ON dd.doc_pk = d.doc_pk
WHERE d.document_id = %(id)s ORDER BY src.root

-- name: document_stages
-- The stage rows of one document: what ran, with which code, how it ended.
SELECT stage, model_id, status, attempts, error_class, last_error, code_version, started_at, finished_at
FROM app.stage_runs WHERE doc_pk = %(doc)s ORDER BY started_at, stage, model_id

-- name: set_actor
-- Who is acting in this transaction: the history trigger records it for a
-- requeue (a transition with no lease owner).
SELECT set_config('pipeline.actor', %(actor)s, true)

-- name: requeue_job_ids
-- Failed jobs a requeue selects: not discarded, of one error class or all.
SELECT j.job_id FROM app.embedding_jobs j
WHERE j.status = 'failed'
  AND (%(cls)s::text IS NULL OR j.error_class = %(cls)s::text)
  AND NOT EXISTS (SELECT 1 FROM app.dlq_discards dd WHERE dd.job_id = j.job_id)
ORDER BY j.job_id

-- name: discard_jobs
-- Give up on failed jobs: record who and why (once per dead letter; a second
-- discard replaces the first), and add the discard to each job's history.
WITH target AS (
    SELECT job_id, attempts, error_class FROM app.embedding_jobs
    WHERE job_id = ANY(%(ids)s) AND status = 'failed'
    FOR UPDATE
), recorded AS (
    INSERT INTO app.dlq_discards (job_id, error_class, discarded_by, reason)
    SELECT job_id, error_class, %(by)s, %(reason)s FROM target
    ON CONFLICT (job_id) DO UPDATE
    SET discarded_by = EXCLUDED.discarded_by, reason = EXCLUDED.reason, discarded_at = now()
    RETURNING job_id
), history AS (
    INSERT INTO app.job_attempts (job_id, actor, attempt, outcome, status, error_class, error_message)
    SELECT job_id, %(by)s, attempts, 'discarded', 'failed', error_class, %(reason)s FROM target
    RETURNING job_id
)
SELECT r.job_id FROM recorded r JOIN history h USING (job_id)

-- name: trim_attempts
-- Keep the newest app.job_attempts_kept() history rows of these jobs (after a
-- discard added one; the trigger trims after the rows it writes).
SELECT count(app.trim_job_attempts(job_id)) FROM unnest(%(ids)s::bigint[]) AS t(job_id)

-- name: lift_document_discards
-- A person requeued these documents by name: their discard no longer holds.
DELETE FROM app.dlq_discards WHERE doc_pk = ANY(%(docs)s)

-- name: discard_documents
-- Give up on quarantined documents (every source's document with that id).
INSERT INTO app.dlq_discards (doc_pk, error_class, discarded_by, reason)
SELECT d.doc_pk, d.error_class, %(by)s, %(reason)s FROM app.documents d
WHERE d.document_id = ANY(%(ids)s) AND d.status = 'quarantined'
ON CONFLICT (doc_pk) DO UPDATE
SET discarded_by = EXCLUDED.discarded_by, reason = EXCLUDED.reason, discarded_at = now()
RETURNING doc_pk
