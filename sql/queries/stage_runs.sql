-- Per-item stage state, app.stage_runs (pipeline_assets/store/stage_runs.py).

-- name: embed_state
-- Each current document x model's embed state from its jobs: succeeded when every chunk is ready,
-- failed when one failed, else pending. Template fields: "models" (embed_models_*), "scope"
-- (embed_scope_*). Read by refresh_embed (stored) and embed_counts (not stored).
SELECT d.doc_pk, m.model_id,
       CASE WHEN bool_or(j.status = 'failed') THEN 'failed'
            WHEN bool_and(coalesce(j.status = 'ready', false)) THEN 'succeeded'
            ELSE 'pending' END AS status,
       greatest(coalesce(max(j.attempts), 0), 1) AS attempts,
       max(j.error_class) FILTER (WHERE j.status = 'failed') AS error_class,
       max(j.error_message) FILTER (WHERE j.status = 'failed') AS last_error,
       d.source_checksum,
       coalesce(min(j.created_at), now()) AS started_at,
       CASE WHEN bool_and(coalesce(j.status IN ('ready', 'failed'), false)) THEN max(j.updated_at) END
           AS finished_at
FROM app.documents d
JOIN app.chunks c ON c.doc_pk = d.doc_pk
JOIN app.models m ON {models}
LEFT JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum AND k.model_id = m.model_id
LEFT JOIN app.embedding_jobs j ON j.job_id = k.job_id
WHERE d.status = 'current' AND {scope}
GROUP BY d.doc_pk, m.model_id

-- name: embed_models_one
-- The embed stage of one model (a fragment of the stage queries).
m.model_id = %(model)s

-- name: embed_models_active
-- The embed stage of every active model (a fragment of the stage queries).
m.active

-- name: embed_scope_all
-- Every current document (reconcile's full refresh).
true

-- name: embed_scope_docs
-- Some documents (a per-call list).
d.doc_pk = ANY(%(docs)s::bigint[])

-- name: embed_scope_touched
-- The documents a work run touched: a vector stored or a job failed since it started, plus those
-- whose stored row says failed.
d.doc_pk = ANY(ARRAY(
    SELECT c.doc_pk FROM app.chunks c
    WHERE c.chunk_checksum IN (
        SELECT e.chunk_checksum FROM app.embeddings e
        WHERE e.model_id = %(model)s AND e.created_at >= %(since)s
        UNION
        SELECT j.chunk_checksum FROM app.embedding_jobs j
        WHERE j.status = 'failed' AND j.updated_at >= %(since)s AND j.model_id = %(model)s)
    UNION
    SELECT s.doc_pk FROM app.stage_runs s
    WHERE s.stage = 'embed' AND s.status = 'failed' AND s.model_id = %(model)s))

-- name: refresh_embed
-- Store the embed rows of embed_state (the field "state", for one model), writing only rows
-- that changed. code_version of an embed row is its model.
INSERT INTO app.stage_runs AS s (doc_pk, stage, model_id, status, attempts, error_class, last_error,
                                 code_version, source_checksum, started_at, finished_at)
SELECT e.doc_pk, 'embed', e.model_id, e.status, e.attempts, e.error_class, e.last_error,
       e.model_id, e.source_checksum, e.started_at, e.finished_at
FROM ({state}) e
ON CONFLICT (doc_pk, stage, model_id) DO UPDATE
SET status = EXCLUDED.status, attempts = EXCLUDED.attempts, error_class = EXCLUDED.error_class,
    last_error = EXCLUDED.last_error, code_version = EXCLUDED.code_version,
    source_checksum = EXCLUDED.source_checksum, finished_at = EXCLUDED.finished_at
WHERE (s.status, s.attempts, s.code_version, s.source_checksum, s.error_class, s.finished_at)
      IS DISTINCT FROM (EXCLUDED.status, EXCLUDED.attempts, EXCLUDED.code_version, EXCLUDED.source_checksum,
                        EXCLUDED.error_class, EXCLUDED.finished_at)

-- name: refresh_embed_drained
-- refresh_embed (the field "refresh", composed, RETURNING 1) in a statement that also reads the clock
-- and whether a job of the model is outstanding, all in its one snapshot: with none outstanding, every
-- job transition older than "until" is in the rows written (a later one is dated from "until" on).
WITH written AS ({refresh} RETURNING 1)
SELECT now() AS until,
       (SELECT min(available_at) FROM app.embedding_jobs
        WHERE model_id = %(model)s AND status IN ('pending', 'retry')) IS NOT NULL
       OR EXISTS (SELECT 1 FROM app.embedding_jobs WHERE status = 'processing' AND model_id = %(model)s)
           AS outstanding,
       (SELECT count(*) FROM written) AS written

-- name: embed_counts
-- The embed stage as status shows it, from the jobs ("state": embed_state), never stored: documents
-- per model and status, and per document over every active model (model_id NULL).
WITH e AS ({state}),
per_doc AS (
    SELECT CASE WHEN bool_or(status = 'failed') THEN 'failed'
                WHEN bool_and(status = 'succeeded') THEN 'succeeded'
                ELSE 'pending' END AS status
    FROM e GROUP BY doc_pk)
SELECT model_id, status, count(*) AS n FROM e GROUP BY model_id, status
UNION ALL
SELECT NULL, status, count(*) FROM per_doc GROUP BY status
ORDER BY 1 NULLS FIRST, 2

-- name: clock
-- The database clock: a work run's "since".
SELECT now()

-- name: rerun_targets
-- The targets of a partial rerun (the CLI and the rerun sensor), every filter optional: stage,
-- statuses, error class, id patterns, a version other than the current (per format) or older than
-- before_version, a source and its buckets. Keyset pages; columns as stages.RerunTarget.
SELECT src.root, d.document_id, s.stage, s.status, s.error_class, s.code_version
FROM app.stage_runs s
JOIN app.documents d ON d.doc_pk = s.doc_pk
JOIN app.sources src ON src.source_id = d.source_id
LEFT JOIN unnest(%(ext_keys)s::text[], %(ext_versions)s::text[]) AS cur(ext, version)
       ON cur.ext = lower(substring(d.document_id FROM '[^/](\.[^./]+)$'))
WHERE d.status <> 'deleted'
  AND s.stage = %(stage)s
  AND (%(model)s::text IS NULL OR s.model_id = %(model)s)
  AND (%(statuses)s::text[] IS NULL OR s.status = ANY(%(statuses)s::text[]))
  AND (%(error_class)s::text IS NULL OR (s.status = 'failed' AND s.error_class = %(error_class)s))
  AND (%(documents)s::text[] IS NULL OR d.document_id LIKE ANY(%(documents)s::text[]))
  AND (%(not_version)s::text IS NULL OR s.code_version IS DISTINCT FROM coalesce(cur.version, %(not_version)s))
  AND (%(before_version)s::text IS NULL
       OR (regexp_replace(s.code_version, '[0-9]+$', '') = regexp_replace(%(before_version)s, '[0-9]+$', '')
           AND substring(s.code_version FROM '([0-9]+)$')::numeric
               < substring(%(before_version)s FROM '([0-9]+)$')::numeric))
  AND (%(failed_only)s = false OR s.status = 'failed')
  AND (%(root)s::text IS NULL OR src.root = %(root)s)
  AND d.document_id > %(after)s
  AND (%(buckets)s::int[] IS NULL OR (d.bucket = ANY(%(buckets)s::int[]) OR d.bucket IS NULL AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s::int[])))
ORDER BY src.root, d.document_id, s.model_id
LIMIT %(limit)s

-- name: rerun_failed_jobs
-- The failed jobs of a model for the current chunks of some documents (an embed rerun requeues them).
SELECT DISTINCT j.job_id
FROM app.documents d
JOIN app.sources src ON src.source_id = d.source_id
JOIN app.chunks c ON c.doc_pk = d.doc_pk
JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum AND k.model_id = %(model)s
JOIN app.embedding_jobs j ON j.job_id = k.job_id
WHERE src.root = %(root)s AND d.document_id = ANY(%(ids)s::text[]) AND d.status = 'current'
  AND j.status = 'failed'

-- name: rerun_document_pks
-- The current documents of a source among some ids (an embed rerun enqueues their missing jobs).
SELECT d.doc_pk
FROM app.documents d JOIN app.sources src ON src.source_id = d.source_id
WHERE src.root = %(root)s AND d.document_id = ANY(%(ids)s::text[]) AND d.status = 'current'
