-- A table source's own database (store/table_source.py). Identifiers are psycopg.sql.Identifier
-- from a validated source string; {id_type} is the id column's regtype. No SQL comes from the source.

-- name: relation
-- The relation a source names (a table or a view), NULL when there is none.
SELECT c.oid, has_table_privilege(c.oid, 'SELECT') AS readable
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(table)s

-- name: columns
-- The named columns of a relation that exist, with their types.
SELECT a.attname, a.atttypid::regtype::text
FROM pg_attribute a
WHERE a.attrelid = %(oid)s AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY(%(names)s)

-- name: set_timeouts
-- A locked table or a stuck server is an error of this scan, not a hang.
SELECT set_config('lock_timeout', %(lock)s, false), set_config('statement_timeout', %(statement)s, false)

-- name: total_full
-- The whole table's digest: rows and bit_xor of their versions (one aggregate, no
-- grouping, as cheap as a count). Equal to the stored one: nothing changed.
SELECT count(*), coalesce(bit_xor(hashtextextended(coalesce({text}::text, ''), hashtextextended({id}::text, 0))), 0)
FROM {table}

-- name: digest_full
-- The table's digest per bucket: rows and bit_xor of their versions. Compared with
-- the stored digest, an equal bucket needs no row of it read. (OFFSET 0 keeps the
-- narrow subquery apart, so the rows are hashed into 4096 groups, never sorted.)
SELECT b, count(*), bit_xor(x)
FROM (SELECT (h & %(mask)s)::int AS b, hashtextextended(coalesce(t, ''), h) AS x
      FROM (SELECT hashtextextended({id}::text, 0) AS h, {text}::text AS t FROM {table}) s OFFSET 0) s2
GROUP BY 1

-- name: list_buckets
-- Every row of some buckets with its change token (no text leaves the server).
SELECT row_id, h, hashtextextended(coalesce(t, ''), h)
FROM (SELECT {id}::text AS row_id, hashtextextended({id}::text, 0) AS h, {text}::text AS t FROM {table}) s
WHERE (h & %(mask)s)::int IN (SELECT unnest(%(buckets)s::int[]))   -- hashed: many buckets cost one probe

-- name: list_updated
-- Rows whose updated column is at or past the watermark (every row when it is NULL),
-- with their change token and updated value.
SELECT {id}::text, hashtextextended({id}::text, 0) AS h,
       hashtextextended(coalesce({text}::text, ''), hashtextextended({id}::text, 0)), {updated}::text
FROM {table}
WHERE %(mark)s::text IS NULL OR {updated} >= %(mark)s::text::{updated_type}

-- name: read_rows
-- Some rows by id: their change token, text size, and text unless it is over the
-- size guard (%(max_bytes)s): an oversize row is quarantined without its text leaving
-- the server.
SELECT {id}::text, h, hashtextextended(coalesce(t, ''), h), octet_length(t),
       CASE WHEN octet_length(t) <= %(max_bytes)s THEN t END
FROM (SELECT {id}, hashtextextended({id}::text, 0) AS h, {text}::text AS t FROM {table}
      WHERE {id} = ANY(%(ids)s::text[]::{id_type}[])) s

-- name: newest_updated
-- The watermark a watermark scan stores: read before its listing, so a row updated
-- during the listing is listed again by the next scan.
SELECT max({updated})::text FROM {table}

-- name: list_all
-- Every row with its change token and text size (no text leaves the server): the
-- complete listing of the generic source interface (items, the sensor's observe).
SELECT row_id, h, hashtextextended(coalesce(t, ''), h), octet_length(t)
FROM (SELECT {id}::text AS row_id, hashtextextended({id}::text, 0) AS h, {text}::text AS t FROM {table}) s
