-- The context of a log line about jobs (jobqueue/job_log.py), read only when that
-- line is going to be written: each job's attempts so far and one document
-- that carries its content (the first by document id; none once nothing does).

-- name: job_context
-- What a log line says of a job: attempts and the document of its chunk.
SELECT j.job_id, j.attempts,
       (SELECT d.document_id FROM app.chunks c JOIN app.documents d ON d.doc_pk = c.doc_pk
        WHERE c.chunk_checksum = k.chunk_checksum ORDER BY d.document_id LIMIT 1) AS document_id
FROM app.embedding_jobs j JOIN app.job_keys k ON k.job_id = j.job_id
WHERE j.job_id = ANY(%(ids)s)
