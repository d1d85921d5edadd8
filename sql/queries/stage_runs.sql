-- Per-item stage state, app.stage_runs (pipeline_assets/app/stages.py).

-- name: refresh_embed
-- The embed row of every current document, derived from its jobs for a model:
-- one set-based statement, writing only rows that changed.
INSERT INTO app.stage_runs AS s (doc_pk, stage, status, attempts, error_class, last_error, code_version,
                                 source_checksum, started_at, finished_at)
SELECT d.doc_pk, 'embed',
       CASE WHEN bool_or(j.status = 'failed') THEN 'failed'
            WHEN bool_and(j.status = 'ready') THEN 'succeeded'
            ELSE 'pending' END,
       greatest(coalesce(max(j.attempts), 0), 1),
       max(j.error_class) FILTER (WHERE j.status = 'failed'),
       max(j.error_message) FILTER (WHERE j.status = 'failed'),
       %(model)s, d.source_checksum, min(j.created_at),
       CASE WHEN bool_and(j.status IN ('ready', 'failed')) THEN max(j.updated_at) END
FROM app.documents d
JOIN app.chunks c ON c.doc_pk = d.doc_pk
JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum AND k.model_id = %(model)s
JOIN app.embedding_jobs j ON j.job_id = k.job_id
WHERE d.status = 'current'
GROUP BY d.doc_pk, d.source_checksum
ON CONFLICT (doc_pk, stage) DO UPDATE
SET status = EXCLUDED.status, attempts = EXCLUDED.attempts, error_class = EXCLUDED.error_class,
    last_error = EXCLUDED.last_error, code_version = EXCLUDED.code_version,
    source_checksum = EXCLUDED.source_checksum, finished_at = EXCLUDED.finished_at
WHERE (s.status, s.code_version, s.source_checksum, s.error_class)
      IS DISTINCT FROM (EXCLUDED.status, EXCLUDED.code_version, EXCLUDED.source_checksum, EXCLUDED.error_class)

-- name: rerun_targets
-- Documents whose stage ran under another code version, or failed with a given
-- error class: the targets of a partial rerun. Columns are named as the fields
-- of stages.RerunTarget.
SELECT src.root, d.document_id, s.stage, s.status, s.error_class, s.code_version
FROM app.stage_runs s
JOIN app.documents d ON d.doc_pk = s.doc_pk
JOIN app.sources src ON src.source_id = d.source_id
WHERE d.status <> 'deleted'
  AND s.stage = %(stage)s
  AND (%(error_class)s::text IS NULL OR (s.status = 'failed' AND s.error_class = %(error_class)s))
  AND (%(not_version)s::text IS NULL OR s.code_version IS DISTINCT FROM %(not_version)s)
  AND (%(failed_only)s = false OR s.status = 'failed')
ORDER BY src.root, d.document_id
LIMIT %(limit)s
