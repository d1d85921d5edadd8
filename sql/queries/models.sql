-- The model registry (pipeline_assets/jobs/models.py): app.models and the
-- per-model HNSW indexes on app.embeddings.

-- name: insert_model
-- Register a model; RETURNING yields a row only when it was new.
INSERT INTO app.models (model_id, provider, name, dimension, max_input_tokens)
VALUES (%(model)s, %(provider)s, %(name)s, %(dimension)s, %(max_input_tokens)s)
ON CONFLICT (model_id) DO NOTHING
RETURNING model_id

-- name: reactivate
-- Back after `models retire`.
UPDATE app.models SET active = true WHERE model_id = %(model)s AND NOT active

-- name: dimension
SELECT dimension FROM app.models WHERE model_id = %(model)s

-- name: record_dimension
-- First response of a model whose dimension was unknown.
UPDATE app.models SET dimension = %(dimension)s WHERE model_id = %(model)s AND dimension IS NULL

-- name: lock_index_build
-- Serialise builders of one index (released at commit).
SELECT pg_advisory_xact_lock(hashtext(%(name)s))

-- name: index_exists
SELECT 1 FROM pg_indexes WHERE schemaname = 'app' AND indexname = %(name)s

-- name: create_hnsw_index
-- A psycopg.sql template, not a parameterised query (DDL takes no parameters):
-- name is an sql.Identifier, dim and model are sql.Literal values. The index is
-- a partial expression index, since one column holds vectors of several
-- dimensions.
CREATE INDEX {name} ON app.embeddings
USING hnsw ((embedding::vector({dim})) vector_cosine_ops)
WHERE model_id = {model}

-- name: resolve_model_id
-- A configured model name (PIPELINE_EMBEDDING_MODEL) to its model_id.
SELECT model_id FROM app.models WHERE name = %(name)s OR model_id = %(name)s
ORDER BY active DESC, created_at DESC LIMIT 1

-- name: active_model_ids
SELECT model_id FROM app.models WHERE active ORDER BY model_id

-- name: list_models
SELECT m.model_id, m.name, m.provider, m.dimension, m.active,
       count(j.job_id) FILTER (WHERE j.status = 'ready') AS ready,
       count(j.job_id) FILTER (WHERE j.status IN ('pending', 'retry', 'processing')) AS outstanding
FROM app.models m LEFT JOIN app.embedding_jobs j ON j.model_id = m.model_id
GROUP BY m.model_id ORDER BY m.created_at

-- name: deactivate
-- `models retire`: new content is no longer enqueued for it.
UPDATE app.models SET active = false WHERE model_id = %(model)s
