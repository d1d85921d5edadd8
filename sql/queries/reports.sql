-- Read-only views for people and the Dagster layer (store/reports.py): status, spend, dead-letter
-- growth, per-document and health read models. The Dagster layer holds no SQL of its own.

-- name: status_by_model
-- Jobs by model and state, for `status`.
SELECT model_id, status, count(*) AS n FROM app.embedding_jobs GROUP BY model_id, status ORDER BY 1, 2

-- name: backlog
-- Jobs waiting for a worker, every model: status's `backlog`, and verbatim the query of the
-- KEDA trigger that scales the workers (deploy/k8s/worker-scaledobject.yaml; test_k8s checks).
-- Counted from the partial index embedding_jobs_claimable (its predicate is this one).
SELECT count(*) AS backlog FROM app.embedding_jobs WHERE status IN ('pending', 'retry')

-- name: stages
-- The stored stages (extract, chunk); status computes the embed stage from
-- the jobs instead (stages.embed_counts).
SELECT stage, status, count(*) AS n FROM app.stage_runs WHERE stage <> 'embed'
GROUP BY stage, status ORDER BY 1, 2

-- name: documents
-- Documents by state, for `status`.
SELECT status, count(*) AS n FROM app.documents GROUP BY status ORDER BY 1

-- name: sources
-- Each ingested source (its key and kind) with its documents by status and its last complete scan.
SELECT s.root AS source, s.kind, s.last_scan_at,
       count(d.doc_pk) FILTER (WHERE d.status = 'current') AS current,
       count(d.doc_pk) FILTER (WHERE d.status = 'quarantined') AS quarantined,
       count(d.doc_pk) FILTER (WHERE d.status = 'deleted') AS deleted
FROM app.sources s LEFT JOIN app.documents d ON d.source_id = s.source_id
GROUP BY s.source_id ORDER BY s.source_id

-- name: quarantined_count
-- Documents quarantined (the dead letters of extraction).
SELECT count(*) AS n FROM app.documents WHERE status = 'quarantined'

-- name: coverage
-- Wanted = distinct checksums of current chunks (per active model); ready = those with a vector.
SELECT m.model_id,
       (SELECT count(DISTINCT c.chunk_checksum) FROM app.chunks c) AS wanted,
       (SELECT count(*) FROM (SELECT DISTINCT c.chunk_checksum FROM app.chunks c) w
        WHERE EXISTS (SELECT 1 FROM app.embeddings e
                      WHERE e.chunk_checksum = w.chunk_checksum AND e.model_id = m.model_id)) AS ready
FROM app.models m WHERE m.active ORDER BY m.model_id

-- name: spend
-- Provider calls per model: how many, tokens billed, inputs answered, calls failed.
SELECT model_id, count(*) AS calls, coalesce(sum(tokens), 0) AS tokens,
       coalesce(sum(inputs) FILTER (WHERE outcome = 'ok'), 0) AS inputs_ok,
       count(*) FILTER (WHERE outcome <> 'ok') AS failed_calls
FROM app.provider_calls GROUP BY model_id ORDER BY model_id

-- name: duplicate_sends
-- Duplicate spend: inputs sent (billed or possibly billed) more than once for the same content and
-- model; a refused send does not count, a model without any has no row.
SELECT model_id, count(*) AS inputs_sent_more_than_once, sum(sends - 1)::bigint AS extra_sends
FROM app.input_sends WHERE sends > 1
GROUP BY model_id ORDER BY model_id

-- name: breaker
-- Each model's shared breaker that has met a failure: closed, open (paused_for more seconds) or
-- half-open (one probe claim at a time; probe_out while one is in flight).
SELECT model_id,
       CASE WHEN paused_until > now() THEN 'open' WHEN tripped THEN 'half-open' ELSE 'closed' END AS state,
       CASE WHEN paused_until > now() THEN extract(epoch FROM paused_until - now())::float8 ELSE 0.0 END
           AS paused_for,
       consecutive_failures,
       tripped AND probe_owner IS NOT NULL AND probe_until > now() AS probe_out
FROM app.provider_state ORDER BY model_id

-- name: database_state
-- Whether this session may write (read-only database or a standby refuses: workers wait), and the
-- workers' liveness (beating or silent) with the age of the newest beat.
SELECT current_setting('transaction_read_only')::bool AS read_only, pg_is_in_recovery() AS in_recovery,
       (SELECT count(*) FROM app.workers WHERE alive_until >= now()) AS workers_beating,
       (SELECT count(*) FROM app.workers WHERE alive_until < now()) AS workers_silent,
       (SELECT extract(epoch FROM now() - max(beat_at))::float8 FROM app.workers) AS last_beat_seconds

-- name: document_summaries
-- One row per requested document of a source: its state, versions and a digest
-- of its current chunk checksums in chunk order (the chunks' data version).
-- Columns are named as the fields of reports.DocumentSummary; checksums as hex.
SELECT d.document_id, d.doc_pk, d.status,
       encode(d.source_checksum, 'hex') AS source_checksum,
       encode(d.text_checksum, 'hex') AS text_checksum,
       d.extractor_version, d.chunker_version, d.error_class,
       count(c.chunk_index) AS chunks,
       coalesce(sum(c.token_count), 0) AS tokens,
       encode(sha256(coalesce(string_agg(c.chunk_checksum, ''::bytea ORDER BY c.chunk_index), ''::bytea)),
              'hex') AS chunks_digest
FROM app.documents d
JOIN app.sources s ON s.source_id = d.source_id
LEFT JOIN app.chunks c ON c.doc_pk = d.doc_pk
WHERE s.root = %(root)s AND d.document_id = ANY(%(ids)s)
GROUP BY d.doc_pk

-- name: embedding_coverage
-- Embedding state of the distinct chunk checksums of some documents for one
-- model; the grouping-set row with document_id NULL is the distinct total.
SELECT d.document_id,
       count(DISTINCT c.chunk_checksum) AS wanted,
       count(DISTINCT c.chunk_checksum) FILTER (WHERE j.status = 'ready' AND e.chunk_checksum IS NOT NULL) AS ready,
       count(DISTINCT c.chunk_checksum) FILTER (WHERE j.status = 'failed') AS failed,
       count(DISTINCT c.chunk_checksum) FILTER (WHERE j.job_id IS NULL
                                                   OR j.status IN ('pending', 'retry', 'processing')) AS waiting
FROM app.documents d
JOIN app.sources s ON s.source_id = d.source_id
JOIN app.chunks c ON c.doc_pk = d.doc_pk
LEFT JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum AND k.model_id = %(model)s
LEFT JOIN app.embedding_jobs j ON j.job_id = k.job_id
LEFT JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %(model)s
WHERE s.root = %(root)s AND d.document_id = ANY(%(ids)s) AND d.status = 'current'
GROUP BY GROUPING SETS ((d.document_id), ())

-- name: stale_vectors
-- Vectors that must not be current: stored without a ready job (superseded,
-- failed, pending...), or reachable from a document that is not current.
SELECT
  (SELECT count(*) FROM app.embeddings e WHERE NOT EXISTS (
       SELECT 1 FROM app.job_keys k JOIN app.embedding_jobs j ON j.job_id = k.job_id AND j.status = 'ready'
       WHERE k.chunk_checksum = e.chunk_checksum AND k.model_id = e.model_id)) AS not_ready,
  (SELECT count(*) FROM app.chunks c
   JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status <> 'current'
   JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum) AS noncurrent_documents,
  (SELECT array_agg(x) FROM (
       SELECT e.model_id || ':' || encode(e.chunk_checksum, 'hex') AS x FROM app.embeddings e
       WHERE NOT EXISTS (SELECT 1 FROM app.job_keys k JOIN app.embedding_jobs j
                         ON j.job_id = k.job_id AND j.status = 'ready'
                         WHERE k.chunk_checksum = e.chunk_checksum AND k.model_id = e.model_id)
       ORDER BY 1 LIMIT 5) s) AS sample

-- name: dead_letter_growth
-- Growth of the dead-letter queue: jobs that became 'failed' within a window,
-- and the depth; discarded ones (`dlq discard`, app.dlq_discards) count in neither.
SELECT count(*) FILTER (WHERE j.updated_at > now() - make_interval(secs => %(window)s)) AS recent,
       count(*) AS total
FROM app.embedding_jobs j
WHERE j.status = 'failed' AND NOT EXISTS (SELECT 1 FROM app.dlq_discards dd WHERE dd.job_id = j.job_id)

-- name: dead_letter_discarded
-- Failed jobs a person gave up on (`dlq discard`).
SELECT count(*) AS n FROM app.dlq_discards dd JOIN app.embedding_jobs j ON j.job_id = dd.job_id
WHERE j.status = 'failed'
