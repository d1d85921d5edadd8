-- The source sensor's observations, app.source_observations (pipeline_assets/store/source_observations.py; the scan: app/observations.py).

-- name: walk_create
-- One scan's walk of the source, copied in as it goes and compared here (no row per file in
-- Python). ``kept``: a document the scan observes; ``checksum``: the listing's content token or NULL.
CREATE TEMP TABLE observations_walked (
    document_id text NOT NULL,
    size        bigint NOT NULL,
    mtime_ns    bigint NOT NULL,
    kept        boolean NOT NULL,
    checksum    text
) ON COMMIT DROP

-- name: walk_copy
-- A scan's walk of the source into this session's table.
COPY observations_walked (document_id, size, mtime_ns, kept, checksum) FROM STDIN

-- name: walk_diff
-- The walked items and the root's observations that differ: one join over the whole listing, into a
-- table each comparison below then reads (an unchanged listing leaves it empty). ``walked`` NULL: an
-- observed file (with a checksum) the walk did not find; ``observed`` NULL: no observation yet.
CREATE TEMP TABLE observations_diff ON COMMIT DROP AS
SELECT w.document_id AS walked, o.document_id AS observed, w.size, w.mtime_ns, w.kept, w.checksum AS listed,
       o.checksum, o.size AS observed_size, o.mtime_ns AS observed_mtime_ns
FROM observations_walked w
FULL JOIN (SELECT document_id, checksum, size, mtime_ns FROM app.source_observations WHERE root = %(root)s) o
  ON o.document_id = w.document_id
WHERE (w.document_id IS NULL AND o.checksum IS NOT NULL)
   OR (w.kept AND (o.document_id IS NULL OR o.checksum IS NULL OR o.size <> w.size OR o.mtime_ns <> w.mtime_ns
                   OR w.checksum IS NOT NULL AND o.checksum IS DISTINCT FROM w.checksum))

-- name: walk_diff_in_buckets
-- The same when the walk copied in only the files of some buckets (of %(n)s): compared with those
-- buckets' observations alone, read through the bucket index, so a bucket scan costs its bucket.
CREATE TEMP TABLE observations_diff ON COMMIT DROP AS
SELECT w.document_id AS walked, o.document_id AS observed, w.size, w.mtime_ns, w.kept, w.checksum AS listed,
       o.checksum, o.size AS observed_size, o.mtime_ns AS observed_mtime_ns
FROM observations_walked w
FULL JOIN (SELECT document_id, checksum, size, mtime_ns FROM app.source_observations
           WHERE root = %(root)s
             AND (bucket = ANY(%(buckets)s)
                  OR bucket IS NULL AND app.document_bucket(document_id, %(n)s) = ANY(%(buckets)s))) o
  ON o.document_id = w.document_id
WHERE (w.document_id IS NULL AND o.checksum IS NOT NULL)
   OR (w.kept AND (o.document_id IS NULL OR o.checksum IS NULL OR o.size <> w.size OR o.mtime_ns <> w.mtime_ns
                   OR w.checksum IS NOT NULL AND o.checksum IS DISTINCT FROM w.checksum))

-- name: stage_listed
-- Items listed with their fingerprint (an object's ETag, a row's version): staged
-- when new or different from the observation, without reading anything.
INSERT INTO observations_in (document_id, checksum, size, mtime_ns)
SELECT walked, listed, size, mtime_ns
FROM observations_diff
WHERE kept AND listed IS NOT NULL
  AND (observed IS NULL OR checksum IS DISTINCT FROM listed
       OR observed_size <> size OR observed_mtime_ns <> mtime_ns)

-- name: stage_unread
-- New files (no observation) modified before %(settled_before)s: staged with a
-- placeholder checksum (``observations.UNREAD``, size, '.', mtime), without reading
-- them: the bucket run that ingests them reads them.
INSERT INTO observations_in (document_id, checksum, size, mtime_ns)
SELECT walked, %(unread)s || size || '.' || mtime_ns, size, mtime_ns
FROM observations_diff
WHERE kept AND listed IS NULL AND mtime_ns < %(settled_before)s AND observed IS NULL

-- name: walked_to_read
-- The walked files the prefilter cannot vouch for: new ones modified since
-- %(settled_before)s (racy), gone ones back, and those whose size or mtime
-- differ from the observation's; with that observation (NULLs: none).
SELECT walked, size, mtime_ns, checksum, observed_size, observed_mtime_ns
FROM observations_diff
WHERE kept AND listed IS NULL
  AND (CASE WHEN observed IS NULL THEN mtime_ns >= %(settled_before)s
            ELSE checksum IS NULL OR observed_size <> size OR observed_mtime_ns <> mtime_ns END)

-- name: walked_missing
-- Observed files (with a checksum) the walk did not find (of the buckets a bucket scan
-- compared): the scan keeps those it observes as gone.
SELECT observed FROM observations_diff WHERE walked IS NULL

-- name: stage_create
-- The observations of one scan that changed, copied in before one upsert.
CREATE TEMP TABLE observations_in (
    document_id text NOT NULL,
    checksum    text NOT NULL,
    size        bigint NOT NULL,
    mtime_ns    bigint NOT NULL
) ON COMMIT DROP

-- name: stage_copy
-- The changed files' checksums into this session's table.
COPY observations_in (document_id, checksum, size, mtime_ns) FROM STDIN

-- name: upsert_staged
-- New files get a row; changed (or re-verified) ones their new checksum, size and mtime.
-- What was requested is left alone: a changed checksum is what makes a row pending.
INSERT INTO app.source_observations AS o (root, document_id, checksum, size, mtime_ns, bucket)
SELECT %(root)s, document_id, checksum, size, mtime_ns,
       app.document_bucket(document_id, (SELECT buckets FROM app.partition_scheme))
FROM observations_in
ON CONFLICT (root, document_id) DO UPDATE
SET checksum = excluded.checksum, size = excluded.size, mtime_ns = excluded.mtime_ns, observed_at = now()

-- name: adopt
-- Seed the table from a legacy cursor map: size -1 makes the next scan read each file once; the
-- files are requested once more after the backoff, like those of a run that ended unsynced.
INSERT INTO app.source_observations (root, document_id, checksum, size, mtime_ns, requested, requested_gen,
                                     request_attempts, bucket)
SELECT %(root)s, d, c, -1, 0, c, %(generation)s, 1, app.document_bucket(d, (SELECT buckets FROM app.partition_scheme))
FROM unnest(%(ids)s::text[], %(checksums)s::text[]) AS m(d, c)
ON CONFLICT (root, document_id) DO NOTHING

-- name: mark_gone
-- Files the scan did not find: pending as tombstones until a tombstone run deletes the rows.
UPDATE app.source_observations
SET checksum = NULL, observed_at = now()
WHERE root = %(root)s AND document_id = ANY(%(ids)s) AND checksum IS NOT NULL

-- name: latest_generation
-- The generation of the latest request: where a sensor whose cursor was cleared goes on from.
SELECT max(requested_gen) FROM app.source_observations WHERE root = %(root)s

-- name: forget_gone
-- After a bucket run tombstoned them: the rows of gone files, unless a scan has
-- seen the file again meanwhile (then it is pending as changed).
DELETE FROM app.source_observations
WHERE root = %(root)s AND document_id = ANY(%(ids)s) AND checksum IS NULL

-- name: mark_synced_as_stored
-- Files a run ingested by id (refresh_documents), not through a bucket run:
-- synced at the checksum of the bytes the ingest stored, so the sensor's next
-- scan, which reads the edited file, finds nothing pending for them.
UPDATE app.source_observations o
SET synced = left(encode(d.source_checksum, 'hex'), 16)
FROM app.documents d JOIN app.sources s ON s.source_id = d.source_id
WHERE o.root = %(root)s AND s.root = o.root AND d.document_id = o.document_id
  AND o.document_id = ANY(%(ids)s::text[]) AND d.status <> 'deleted' AND d.source_checksum IS NOT NULL

-- name: schedule_retries
-- With none of the sensor's runs in flight: files whose requesting run ended without syncing them
-- wait %(base)s * 2^(attempts - 1) seconds, at most %(cap)s, before they are pending again.
UPDATE app.source_observations
SET retry_at = now() + make_interval(secs => least(%(cap)s::float8,
                                                  %(base)s::float8 * power(2, least(greatest(request_attempts, 1), 32) - 1)))
WHERE root = %(root)s AND retry_at IS NULL
  AND requested_gen < %(generation)s
  AND checksum IS NOT DISTINCT FROM requested
  AND (checksum IS NULL OR checksum IS DISTINCT FROM synced)

-- name: waiting_retries
-- Files of ended requests still backing off: how many, and seconds until the first is due.
SELECT count(*), extract(epoch FROM min(retry_at) - now())
FROM app.source_observations
WHERE root = %(root)s AND retry_at > now()
  AND checksum IS NOT DISTINCT FROM requested
  AND (checksum IS NULL OR checksum IS DISTINCT FROM synced)

-- name: pending_buckets
-- The buckets (of %(n)s) holding what the sensor must request, with counts of pending and gone
-- files and a digest of the pending (document, checksum) pairs (the run key). Pending: not synced,
-- and not requested yet, requested by an unsaved tick, or past its retry_at.
SELECT coalesce(bucket, app.document_bucket(document_id, %(n)s)) AS bucket,
       count(*) AS documents,
       count(*) FILTER (WHERE checksum IS NULL) AS gone,
       count(*) FILTER (WHERE requested_gen IS NULL AND checksum IS NOT NULL) AS new,
       md5(string_agg(document_id || '=' || coalesce(checksum, '-'), ',' ORDER BY document_id COLLATE "C")) AS digest
FROM app.source_observations
WHERE root = %(root)s
  AND (checksum IS NULL OR checksum IS DISTINCT FROM synced)
  AND (checksum IS DISTINCT FROM requested OR requested_gen IS NULL OR requested_gen >= %(generation)s
       OR retry_at <= now())
GROUP BY 1
ORDER BY 1

-- name: mark_requested_buckets
-- Every pending file of some buckets, as put into a run request by generation
-- %(generation)s: its attempts count the requests of the same checksum (a
-- replay of the same generation is not one more).
UPDATE app.source_observations
SET requested = checksum, requested_gen = %(generation)s, retry_at = NULL,
    request_attempts = CASE WHEN requested_gen >= %(generation)s THEN request_attempts
                            WHEN requested_gen IS NOT NULL AND checksum IS NOT DISTINCT FROM requested
                                THEN request_attempts + 1
                            ELSE 1 END
WHERE root = %(root)s AND (bucket = ANY(%(buckets)s) OR bucket IS NULL AND app.document_bucket(document_id, %(n)s) = ANY(%(buckets)s))
  AND (checksum IS NULL OR checksum IS DISTINCT FROM synced)
  AND (checksum IS DISTINCT FROM requested OR requested_gen IS NULL OR requested_gen >= %(generation)s
       OR retry_at <= now())

-- name: retry_now
-- Files of some documents waiting out the backoff of a failed request, which a
-- reconciliation has just re-ingested: due now, so the next free tick requests
-- the bucket run that embeds their new chunks.
UPDATE app.source_observations
SET retry_at = now()
WHERE root = %(root)s AND document_id = ANY(%(ids)s::text[]) AND retry_at > now()

-- name: unsync_unembedded
-- After a failed or cancelled run over buckets %(first)s..%(last)s (of %(n)s): its synced files
-- whose document still lacks a vector of %(model)s count as requested and unsynced again.
UPDATE app.source_observations o
SET synced = NULL, requested = o.checksum, retry_at = NULL
FROM app.documents d JOIN app.sources s ON s.source_id = d.source_id
WHERE o.root = %(root)s AND s.root = o.root AND d.document_id = o.document_id AND d.status = 'current'
  AND o.synced IS NOT NULL AND o.checksum = o.synced
  AND (o.bucket BETWEEN %(first)s AND %(last)s
       OR o.bucket IS NULL AND app.document_bucket(o.document_id, %(n)s) BETWEEN %(first)s AND %(last)s)
  AND EXISTS (SELECT 1 FROM app.chunks c
              WHERE c.doc_pk = d.doc_pk
                AND NOT EXISTS (SELECT 1 FROM app.embeddings e
                                WHERE e.chunk_checksum = c.chunk_checksum AND e.model_id = %(model)s))
