-- A source's documents, a document's chunks and its stage rows carry no foreign key.
--
-- The three foreign keys ran a referential-integrity trigger for every row an
-- ingest writes: one SPI query per document (its source), per chunk and per
-- stage row (their document), each taking a KEY SHARE lock on a row the same
-- transaction had just written; most of an ingest batch's documents statement,
-- and the chunks' COPY and the embed stage rows' refresh paid the same per row.
-- What they guarded holds without them:
--   * documents are written only by the ingest's upsert (sql/queries/documents.sql
--     write_documents) with the source_id of the source row it ensured; no code
--     deletes a source or a document (a removed file is a tombstone: status
--     'deleted');
--   * chunks are written only by the ingest's COPY, for the doc_pk that upsert
--     returned in the same transaction; stage rows only by that upsert (from its
--     RETURNING) and by the embed refresh, which reads the documents it writes
--     rows for (sql/queries/stage_runs.sql refresh_embed);
--   * a manual DELETE or TRUNCATE of documents still takes their chunks and stage
--     rows along (one statement for all of them, as the cascade did), and a
--     manual DELETE or TRUNCATE of a source that still has documents is refused.
ALTER TABLE app.documents DROP CONSTRAINT documents_source_id_fkey;
ALTER TABLE app.chunks DROP CONSTRAINT chunks_doc_pk_fkey;
ALTER TABLE app.stage_runs DROP CONSTRAINT stage_runs_doc_pk_fkey;

CREATE FUNCTION app.forget_deleted_documents() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM app.chunks c USING gone g WHERE c.doc_pk = g.doc_pk;
    DELETE FROM app.stage_runs s USING gone g WHERE s.doc_pk = g.doc_pk;
    RETURN NULL;
END $$;
CREATE TRIGGER documents_forget_deleted
AFTER DELETE ON app.documents REFERENCING OLD TABLE AS gone
FOR EACH STATEMENT EXECUTE FUNCTION app.forget_deleted_documents();

CREATE FUNCTION app.forget_truncated_documents() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Only a table the TRUNCATE left rows in: one it listed is in use by it, and empty.
    IF EXISTS (SELECT 1 FROM app.chunks) THEN
        TRUNCATE app.chunks;
    END IF;
    IF EXISTS (SELECT 1 FROM app.stage_runs) THEN
        TRUNCATE app.stage_runs;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER documents_forget_truncated
AFTER TRUNCATE ON app.documents
FOR EACH STATEMENT EXECUTE FUNCTION app.forget_truncated_documents();

CREATE FUNCTION app.refuse_used_source_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM app.documents d JOIN gone g ON d.source_id = g.source_id) THEN
        RAISE EXCEPTION 'a source that still has documents cannot be deleted' USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER sources_refuse_used_delete
AFTER DELETE ON app.sources REFERENCING OLD TABLE AS gone
FOR EACH STATEMENT EXECUTE FUNCTION app.refuse_used_source_delete();

CREATE FUNCTION app.refuse_used_source_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM app.documents) THEN
        RAISE EXCEPTION 'sources that still have documents cannot be truncated' USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER sources_refuse_used_truncate
AFTER TRUNCATE ON app.sources
FOR EACH STATEMENT EXECUTE FUNCTION app.refuse_used_source_truncate();
