-- The chunks' text-search vectors, filled after the ingest (pipeline_assets/store/text_search.py).

-- name: fill_pending
-- Compute the 'english' tsvector of up to `limit` chunks that have none yet (the expression sql/010 had),
-- skipping rows another transaction holds (an ingest replacing them, another filler).
WITH pending AS (
    SELECT doc_pk, chunk_index FROM app.chunks WHERE text_search IS NULL
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
UPDATE app.chunks c SET text_search = to_tsvector('english'::regconfig, c.text)
FROM pending p WHERE c.doc_pk = p.doc_pk AND c.chunk_index = p.chunk_index

-- name: pending_count
-- How many chunks still have no text-search vector (through the partial index of sql/042).
SELECT count(*) FROM app.chunks WHERE text_search IS NULL
