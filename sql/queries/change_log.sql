-- The optional change log of a table source (store/change_log.py), in the source's database:
-- triggers record changed ids and TRUNCATEs; entries are deleted only after their rows are ingested.
-- {table}, {id}, {text} are psycopg.sql.Identifier; {id_name} a literal.

-- name: create_schema
-- The change log's own schema, beside the user's table.
CREATE SCHEMA IF NOT EXISTS pipeline_changes

-- name: create_log
-- One entry per change: the source table (schema.name), the row id (NULL: TRUNCATE).
CREATE TABLE IF NOT EXISTS pipeline_changes.log (
    seq       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source    text NOT NULL,
    row_id    text,
    op        "char" NOT NULL,
    logged_at timestamptz NOT NULL DEFAULT now()
)

-- name: create_log_index
-- The change log read per source in sequence order.
CREATE INDEX IF NOT EXISTS log_source_seq ON pipeline_changes.log (source, seq)

-- name: create_function
-- The trigger function: SECURITY DEFINER, so the application's roles that write
-- the table need no grant on our schema. TG_ARGV[0] is the id column's name.
CREATE OR REPLACE FUNCTION pipeline_changes.record() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    src text := TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME;
    old_id text;
    new_id text;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        INSERT INTO pipeline_changes.log (source, row_id, op) VALUES (src, NULL, 'T');
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        EXECUTE format('SELECT ($1).%I::text', TG_ARGV[0]) INTO old_id USING OLD;
        INSERT INTO pipeline_changes.log (source, row_id, op) VALUES (src, old_id, left(TG_OP, 1));
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') THEN
        EXECUTE format('SELECT ($1).%I::text', TG_ARGV[0]) INTO new_id USING NEW;
        IF new_id IS DISTINCT FROM old_id THEN
            INSERT INTO pipeline_changes.log (source, row_id, op) VALUES (src, new_id, left(TG_OP, 1));
        END IF;
    END IF;
    RETURN NULL;
END
$fn$

-- name: drop_row_trigger
-- Remove the row trigger from the user's table (uninstall).
DROP TRIGGER IF EXISTS pipeline_changes_row ON {table}

-- name: drop_update_trigger
-- Remove the update trigger from the user's table (uninstall).
DROP TRIGGER IF EXISTS pipeline_changes_update ON {table}

-- name: drop_truncate_trigger
-- Remove the truncate trigger from the user's table (uninstall).
DROP TRIGGER IF EXISTS pipeline_changes_truncate ON {table}

-- name: create_row_trigger
-- Log every inserted or deleted row id of the user's table.
CREATE TRIGGER pipeline_changes_row AFTER INSERT OR DELETE ON {table}
FOR EACH ROW EXECUTE FUNCTION pipeline_changes.record({id_name})

-- name: create_update_trigger
-- Only updates that change the id or the text are changes of the document.
CREATE TRIGGER pipeline_changes_update AFTER UPDATE ON {table}
FOR EACH ROW WHEN (OLD.{id} IS DISTINCT FROM NEW.{id} OR OLD.{text} IS DISTINCT FROM NEW.{text})
EXECUTE FUNCTION pipeline_changes.record({id_name})

-- name: create_truncate_trigger
-- Log a TRUNCATE of the user's table (every row changed).
CREATE TRIGGER pipeline_changes_truncate AFTER TRUNCATE ON {table}
FOR EACH STATEMENT EXECUTE FUNCTION pipeline_changes.record({id_name})

-- name: installed
-- Whether the change log's triggers are on the table (all three).
SELECT count(*) = 3 FROM pg_trigger
WHERE tgrelid = %(oid)s AND tgname IN ('pipeline_changes_row', 'pipeline_changes_update',
                                       'pipeline_changes_truncate')

-- name: forget_source
-- The entries of a table whose triggers were removed.
DELETE FROM pipeline_changes.log WHERE source = %(source)s

-- name: read_entries
-- The oldest entries of one table, up to %(limit)s.
SELECT seq, row_id, op FROM pipeline_changes.log WHERE source = %(source)s ORDER BY seq LIMIT %(limit)s

-- name: delete_entries
-- Exactly the entries read (never a range: an entry of a transaction that commits
-- later may hold a smaller seq than one already read).
DELETE FROM pipeline_changes.log WHERE seq = ANY(%(seqs)s)

-- name: pending_count
-- Changes logged for a source and not consumed yet.
SELECT count(*) FROM pipeline_changes.log WHERE source = %(source)s

-- name: log_exists
-- Whether the change log is installed in this database.
SELECT to_regclass('pipeline_changes.log') IS NOT NULL
