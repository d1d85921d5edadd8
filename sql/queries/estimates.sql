-- What a run would send to one model (store/estimates.py; the estimate: app/estimate.py), summed in the database over the distinct
-- content of a selection of current chunks: cl100k tokens, already embedded (reused), dead-lettered,
-- left to send. No chunk text leaves the database; each query returns one row.

-- name: summary
-- The estimate over one selection {wanted} (one of the named selections below: the distinct
-- content of some current chunks, with its token count and how many chunks share it).
WITH wanted AS ({wanted})
SELECT coalesce(sum(w.copies), 0) AS chunks, count(*) AS inputs, coalesce(sum(w.tokens), 0) AS tokens,
       count(*) FILTER (WHERE e.chunk_checksum IS NOT NULL) AS embedded,
       coalesce(sum(w.tokens) FILTER (WHERE e.chunk_checksum IS NOT NULL), 0) AS embedded_tokens,
       count(*) FILTER (WHERE e.chunk_checksum IS NULL AND j.status = 'failed') AS failed,
       coalesce(sum(w.tokens) FILTER (WHERE e.chunk_checksum IS NULL AND j.status = 'failed'), 0) AS failed_tokens
FROM wanted w
LEFT JOIN app.embeddings e ON e.chunk_checksum = w.chunk_checksum AND e.model_id = %(model)s
LEFT JOIN app.job_keys k ON k.chunk_checksum = w.chunk_checksum AND k.model_id = %(model)s
LEFT JOIN app.embedding_jobs j ON j.job_id = k.job_id

-- name: corpus
-- The whole current corpus (app.chunks holds only current chunks): `models add`.
SELECT chunk_checksum, min(token_count) AS tokens, count(*) AS copies
FROM app.chunks GROUP BY chunk_checksum

-- name: documents
-- The current chunks of some documents (their keys, one binary bigint[]): a rerun's selection.
SELECT chunk_checksum, min(token_count) AS tokens, count(*) AS copies
FROM app.chunks WHERE doc_pk = ANY(%(pks)s::bigint[]) GROUP BY chunk_checksum

-- name: buckets
-- The current chunks of a source's current documents in some buckets (of %(n)s): an embeddings run.
SELECT c.chunk_checksum, min(c.token_count) AS tokens, count(*) AS copies
FROM app.documents d
JOIN app.sources s ON s.source_id = d.source_id
JOIN app.chunks c ON c.doc_pk = d.doc_pk
WHERE s.root = %(root)s AND d.status = 'current'
  AND (d.bucket = ANY(%(buckets)s) OR d.bucket IS NULL AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s))
GROUP BY c.chunk_checksum
