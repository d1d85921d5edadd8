-- What the pipeline last read of each row of a table source (a `table:` source,
-- pipeline_assets/store/table_rows.py): the row's change token. A row whose
-- version equals the stored one is never read again; the per-bucket count and
-- bit_xor of these rows is compared with the same digest computed in the source
-- database, so an unchanged table is checked without streaming its rows.
--   id_hash  hashtextextended(id::text, 0), computed by the source database; the
--            row's bucket is id_hash & (TABLE_BUCKETS - 1)
--   version  hashtextextended(coalesce(text, ''), id_hash), by the source database
-- A row is recorded only after its document was written (or skipped, or
-- quarantined) in a committed transaction: a crash between the two re-reads it.
CREATE TABLE app.table_rows (
    source   text   NOT NULL,   -- the canonical source string (app.sources.root)
    row_id   text   NOT NULL,   -- id::text: the document id is table:SCHEMA.TABLE/<row_id>
    id_hash  bigint NOT NULL,
    version  bigint NOT NULL,
    PRIMARY KEY (source, row_id)
);
CREATE INDEX table_rows_bucket ON app.table_rows (source, (id_hash & 4095)) INCLUDE (id_hash, version);

-- The watermark of a table source with an updated column: the greatest value of
-- that column (as text, compared in the source database) among the rows read.
CREATE TABLE app.table_marks (
    source    text PRIMARY KEY,
    watermark text NOT NULL,
    marked_at timestamptz NOT NULL DEFAULT now()
);
