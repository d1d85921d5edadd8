-- Full-text search over chunk text (hybrid search, pipeline_assets/app/search.py).
--
-- A STORED generated column, so every way a chunk is written (ingest's COPY,
-- a rerun, a repair) gets its tsvector in the same statement, and rows that
-- existed before this migration get theirs here (the ALTER rewrites the
-- table once, under its lock). The configuration is spelled as a regconfig
-- constant, which keeps the expression immutable (a generated column needs
-- that) and independent of default_text_search_config. 'english' stems and
-- drops English stop words; text in other languages is still indexed word
-- by word, unstemmed.
ALTER TABLE app.chunks
    ADD COLUMN text_search tsvector GENERATED ALWAYS AS (to_tsvector('english'::regconfig, text)) STORED;

-- Text search looks chunks up by lexeme through this index (@@ on a GIN index).
CREATE INDEX chunks_text_search ON app.chunks USING gin (text_search);
