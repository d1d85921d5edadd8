-- Reading the index (pipeline_assets/store/retrieval.py). Every query goes through
-- app.chunks, which holds only current chunks of current documents, so a
-- superseded or tombstoned vector (or chunk text) can never be returned.

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

-- name: snapshot
-- Hybrid search reads both rankings (and the distances of text-only hits) from
-- one snapshot: an ingest committing meanwhile is seen by all three or none.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY

-- name: set_ef_search
-- The HNSW scan yields at most ef_search candidates; ask for enough. A plan
-- made for the model at hand (never a generic plan, which cannot prove a
-- partial index's predicate). Both for this transaction only.
SELECT set_config('hnsw.ef_search', %(ef_search)s, true),
       set_config('plan_cache_mode', 'force_custom_plan', true)

-- name: nearest
-- A psycopg.sql template: kind and dim spell the model's partial HNSW index expression (an exact
-- scan without it); q, model, fetch, k are parameters. Candidates are re-ranked by full-precision
-- distance, then only current chunks of current documents are kept.
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

-- name: text_ranked
-- Current chunks ranked by BM25 over their 'english' lexemes (GIN index, uncommon lexemes first); a
-- chunk whose text-search vector is not filled yet is read from its text. n: the planner's chunk estimate.
WITH n AS (
    SELECT CASE WHEN t.reltuples > 0 THEN t.reltuples::float8
                ELSE (SELECT count(*) FROM app.chunks)::float8 END AS n
    FROM pg_class t WHERE t.oid = 'app.chunks'::regclass),
unfilled AS MATERIALIZED (  -- the chunks without their vector yet: computed here, once
    SELECT c.doc_pk, c.chunk_index, to_tsvector('english'::regconfig, c.text) AS text_search
    FROM app.chunks c WHERE c.text_search IS NULL),
terms AS MATERIALIZED (  -- each lexeme's frequency counted once, not once per use
    SELECT w.lexeme, ((SELECT count(*) FROM app.chunks c WHERE c.text_search @@ quote_literal(w.lexeme)::tsquery)
                      + (SELECT count(*) FROM unfilled u WHERE u.text_search @@ quote_literal(w.lexeme)::tsquery)
                     )::float8 AS df
    FROM (SELECT DISTINCT lexeme FROM unnest(to_tsvector('english'::regconfig, %(words)s))) w),
weighted AS (
    SELECT t.lexeme, t.df, ln(1 + (greatest(n.n, t.df) - t.df + 0.5) / (t.df + 0.5)) AS idf,
           t.df <= greatest(%(common_ratio)s * n.n, %(common_floor)s) AS selective
    FROM terms t CROSS JOIN n WHERE t.df > 0),
selector AS (
    SELECT string_agg(quote_literal(w.lexeme), ' | ')::tsquery AS tsq
    FROM weighted w
    WHERE w.selective OR w.df = (SELECT min(r.df) FROM weighted r WHERE NOT EXISTS (
        SELECT 1 FROM weighted s WHERE s.selective))),
matches AS (
    SELECT c.doc_pk, c.chunk_index, c.text_search FROM selector s JOIN app.chunks c ON c.text_search @@ s.tsq
    UNION ALL
    SELECT u.doc_pk, u.chunk_index, u.text_search FROM selector s JOIN unfilled u ON u.text_search @@ s.tsq),
candidates AS (
    SELECT m.doc_pk, m.chunk_index, length(m.text_search)::float8 AS len,
           avg(length(m.text_search)) OVER ()::float8 AS avg_len,
           -- the chunk's tsvector cut down to the query's lexemes (delete all the others)
           ts_delete(m.text_search, tsvector_to_array(ts_delete(m.text_search, l.lexemes))) AS matched
    FROM matches m
    CROSS JOIN (SELECT array_agg(lexeme) AS lexemes FROM weighted) l),
scored AS (
    SELECT c.doc_pk, c.chunk_index,
           sum(w.idf * u.tf * (%(k1)s + 1)
               / (u.tf + %(k1)s * (1 - %(b)s + %(b)s * c.len / greatest(c.avg_len, 1)))) AS text_rank
    FROM candidates c
    CROSS JOIN LATERAL (SELECT x.lexeme, coalesce(array_length(x.positions, 1), 1)::float8 AS tf
                        FROM unnest(c.matched) x) u
    JOIN weighted w ON w.lexeme = u.lexeme
    GROUP BY c.doc_pk, c.chunk_index)
SELECT d.document_id, d.source_uri, c.chunk_index, c.text, c.chunk_checksum, s.text_rank
FROM scored s
JOIN app.chunks c ON c.doc_pk = s.doc_pk AND c.chunk_index = s.chunk_index
JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current'
ORDER BY s.text_rank DESC, d.document_id, c.chunk_index
LIMIT %(limit)s

-- name: distances
-- Cosine distances of the query to some chunks' vectors under a model, found by primary key;
-- a chunk without a vector has no row.
SELECT e.chunk_checksum, e.embedding <=> %(q)s::vector AS distance
FROM app.embeddings e
WHERE e.model_id = %(model)s AND e.chunk_checksum = ANY(%(checksums)s)
