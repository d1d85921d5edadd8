-- Reading the index (pipeline_assets/app/retrieval.py). Both queries go through
-- app.chunks, which holds only current chunks of current documents, so a
-- superseded or tombstoned vector can never be returned.

-- name: export
-- Current embeddings of a model, one row per current chunk whose job is ready.
-- Read through a named (server-side) cursor, a batch at a time.
SELECT d.document_id, d.source_uri, c.chunk_index, c.text, m.name AS model, e.embedding
FROM app.chunks c
JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current'
JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %(model)s
JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum AND k.model_id = %(model)s
JOIN app.embedding_jobs j ON j.job_id = k.job_id AND j.status = 'ready'
JOIN app.models m ON m.model_id = e.model_id
ORDER BY d.document_id, c.chunk_index

-- name: read_only
-- Export reads only (it also runs under a read-only role or on a standby).
SET TRANSACTION READ ONLY

-- name: set_ef_search
-- The HNSW scan yields at most ef_search candidates; ask for enough. A plan
-- made for the model at hand (never a generic plan, which cannot prove a
-- partial index's predicate). Both for this transaction only.
SELECT set_config('hnsw.ef_search', %(ef_search)s, true),
       set_config('plan_cache_mode', 'force_custom_plan', true)

-- name: nearest
-- A psycopg.sql template with parameters: kind (vector or halfvec, an
-- sql.Identifier) and dim (an sql.Literal) spell the expression of the
-- model's partial HNSW index, so the planner can use it; q, model, fetch and
-- k are query parameters (a model id is never spliced into a query that has
-- parameters: a percent sign in it would read as a placeholder). Before
-- the index exists (or above the indexable dimensions) the same query is an
-- exact scan. Candidates are ranked again by the full-precision distance,
-- then only current chunks of current documents are kept.
WITH nearest AS (
    SELECT e.chunk_checksum, e.embedding::vector({dim}) <=> %(q)s::vector({dim}) AS distance
    FROM app.embeddings e
    WHERE e.model_id = %(model)s
    ORDER BY e.embedding::{kind}({dim}) <=> %(q)s::{kind}({dim})
    LIMIT %(fetch)s)
SELECT d.document_id, d.source_uri, c.chunk_index, c.text, n.distance
FROM nearest n
JOIN app.chunks c ON c.chunk_checksum = n.chunk_checksum
JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current'
ORDER BY n.distance, d.document_id, c.chunk_index
LIMIT %(k)s
