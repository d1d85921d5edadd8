-- What the pipeline last read of a table source: app.table_rows, app.table_marks and
-- app.table_observed (pipeline_assets/store/table_rows.py).

-- name: stored_digest
-- The stored rows' digest per bucket, as the source's digest_full computes it.
SELECT (id_hash & %(mask)s)::int AS bucket, count(*) AS n, bit_xor(version) AS x
FROM app.table_rows WHERE source = %(source)s GROUP BY 1

-- name: stored_total
-- The stored rows' whole digest, as the source's total_full computes it.
SELECT count(*), coalesce(bit_xor(version), 0) FROM app.table_rows WHERE source = %(source)s

-- name: listed_create
-- One scan's listing of the source (row id and change token), copied in as it is
-- streamed: compared here, so a scan holds no row per table row in Python.
CREATE TEMP TABLE IF NOT EXISTS table_listed (
    row_id  text PRIMARY KEY,
    id_hash bigint NOT NULL,
    version bigint NOT NULL
)

-- name: listed_truncate
-- Empty this session's listing of the user's table.
TRUNCATE table_listed

-- name: listed_copy
-- The user's table listed (row id, its hash, its version) into this session's table.
COPY table_listed (row_id, id_hash, version) FROM STDIN

-- name: listed_analyze
-- Statistics of the listing before it is compared.
ANALYZE table_listed

-- name: listed_changed
-- Listed rows whose version is not the stored one (new or changed): to read, a page
-- at a time after %(after)s.
SELECT l.row_id FROM table_listed l
LEFT JOIN app.table_rows r ON r.source = %(source)s AND r.row_id = l.row_id
WHERE r.version IS DISTINCT FROM l.version AND l.row_id > %(after)s
ORDER BY l.row_id LIMIT %(limit)s

-- name: listed_gone
-- Stored rows of the listed buckets that the listing did not find: deleted (a page at
-- a time: each page is tombstoned and forgotten before the next is selected).
SELECT r.row_id FROM app.table_rows r
WHERE r.source = %(source)s AND (r.id_hash & %(mask)s)::int = ANY(%(buckets)s)
  AND NOT EXISTS (SELECT 1 FROM table_listed l WHERE l.row_id = r.row_id)
LIMIT %(limit)s

-- name: record_rows
-- The change tokens of rows just ingested (after their documents were committed).
INSERT INTO app.table_rows AS r (source, row_id, id_hash, version)
SELECT %(source)s, t.row_id, t.h, t.v
FROM unnest(%(ids)s::text[], %(hashes)s::bigint[], %(versions)s::bigint[]) AS t(row_id, h, v)
ON CONFLICT (source, row_id) DO UPDATE SET id_hash = EXCLUDED.id_hash, version = EXCLUDED.version

-- name: forget_rows
-- Rows gone from the source whose documents were tombstoned.
DELETE FROM app.table_rows WHERE source = %(source)s AND row_id = ANY(%(ids)s)

-- name: stored_count
-- Rows stored for a table source.
SELECT count(*) FROM app.table_rows WHERE source = %(source)s

-- name: watermark
-- How far a table source's version column has been read.
SELECT watermark FROM app.table_marks WHERE source = %(source)s

-- name: set_watermark
-- Move a table source's watermark.
INSERT INTO app.table_marks (source, watermark) VALUES (%(source)s, %(mark)s)
ON CONFLICT (source) DO UPDATE SET watermark = EXCLUDED.watermark, marked_at = now()

-- name: observed_any
-- Whether the source sensor holds observations of a source (a complete listing was observed).
SELECT EXISTS (SELECT 1 FROM app.source_observations WHERE root = %(root)s)

-- name: observed_digest
-- The table's digest at the sensor's last complete observation (no row: none holds).
SELECT rows, digest FROM app.table_observed WHERE source = %(source)s

-- name: set_observed_digest
-- The row count and digest a table source last saw (a cheap no-change check).
INSERT INTO app.table_observed (source, rows, digest) VALUES (%(source)s, %(rows)s, %(digest)s)
ON CONFLICT (source) DO UPDATE SET rows = EXCLUDED.rows, digest = EXCLUDED.digest, observed_at = now()

-- name: forget_observed_digest
-- Forget a table source's digest (the next scan compares rows).
DELETE FROM app.table_observed WHERE source = %(source)s
