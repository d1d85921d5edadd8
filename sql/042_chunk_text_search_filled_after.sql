-- The chunks' text-search vectors are computed after the ingest writes the chunks, not in its COPY
-- (store/text_search.py fills them, a batch per transaction): computing them was most of the chunk
-- COPY's cost. The column becomes a plain one; the values it holds are kept (no rewrite). A chunk
-- whose vector is not filled yet (NULL) is still found by full-text search, which reads its text
-- (sql/queries/retrieval.sql, text_ranked) through this partial index, empty once all are filled.
ALTER TABLE app.chunks ALTER COLUMN text_search DROP EXPRESSION;

CREATE INDEX chunks_text_search_pending ON app.chunks (doc_pk, chunk_index) WHERE text_search IS NULL;
