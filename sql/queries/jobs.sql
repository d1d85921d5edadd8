-- The job state machine's SQL (jobqueue/transitions.py; the table: docs/state-machine.md). Each
-- transition is one UPDATE guarded by the state(s) it leaves (and the lease); returned rows are what
-- moved. Status literals are JobStatus values (test_named_queries.py).

-- name: claim
-- pending|retry -> processing: a batch of the scope's jobs (claim_scope_*), lease from the database
-- clock, gated by the provider's pause and breaker (one half-open probe at a time). Commits without
-- waiting for its WAL flush; columns as changes.ClaimedJob (docs/decisions/0007, 0008).
WITH async AS (
    SELECT set_config('synchronous_commit', 'off', true)
), gate AS (
    UPDATE app.provider_state p SET probe_until = now() + make_interval(secs => %(lease)s),
                                    probe_owner = %(owner)s
    WHERE p.model_id = %(model)s AND p.tripped AND p.paused_until <= now() AND p.probe_until <= now()
      AND (SELECT min(w.available_at) FROM app.embedding_jobs w
           WHERE w.model_id = p.model_id AND w.status IN ('pending', 'retry') AND {scope}) <= now()
    RETURNING true AS probe
), picked AS (
    SELECT w.job_id FROM app.embedding_jobs w
    WHERE w.model_id = %(model)s
      AND w.status IN ('pending', 'retry')
      AND w.available_at <= now()
      AND {scope}
      AND EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = %(model)s AND m.active)
      AND (NOT EXISTS (SELECT 1 FROM app.provider_state p
                       WHERE p.model_id = %(model)s AND (p.tripped OR p.paused_until > now()))
           OR EXISTS (SELECT 1 FROM gate))
    ORDER BY w.available_at, w.job_id
    LIMIT {limit}
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE app.embedding_jobs j
    SET status = 'processing',
        lease_owner = %(owner)s,
        lease_expires_at = now() + make_interval(secs => %(lease)s),
        attempts = j.attempts + 1,
        updated_at = now()
    WHERE j.job_id = ANY (ARRAY(SELECT job_id FROM picked)) AND EXISTS (SELECT 1 FROM async)
    RETURNING j.job_id, j.chunk_checksum, j.attempts, j.max_attempts, j.throttles, j.isolate, j.faults,
              coalesce(j.error_class IN ('lease_expired', 'worker_dead'), false) AS crashed
)
SELECT j.job_id, j.chunk_checksum, j.attempts, j.max_attempts, c.text, c.token_count,
       EXISTS (SELECT 1 FROM gate) AS probe, j.throttles, j.isolate, j.faults, j.crashed
FROM claimed j
LEFT JOIN LATERAL (SELECT c.text, c.token_count FROM app.chunks c
                   WHERE c.chunk_checksum = j.chunk_checksum LIMIT 1) AS c ON true

-- name: claim_scope_all
-- The whole queue of the model.
true

-- name: claim_scope_docs
-- The jobs of some documents' current chunks (%(docs)s: their doc_pk), found
-- through the identity (chunks by document, then job_keys), not the queue.
w.job_id IN (SELECT k.job_id FROM app.job_keys k
             WHERE k.model_id = %(model)s
               AND k.chunk_checksum IN (SELECT c.chunk_checksum FROM app.chunks c WHERE c.doc_pk = ANY(%(docs)s)))

-- name: release_probe
-- The probe slot goes free at once when the claim holding it found nothing,
-- failed or ended without closing the breaker: no worker waits out a lease.
UPDATE app.provider_state SET probe_until = '-infinity', probe_owner = NULL, updated_at = now()
WHERE model_id = %(model)s AND probe_owner = %(owner)s

-- name: mark_isolated
-- changes.Isolate. A batch was refused for a bad input and is being split:
-- should the split be cut short (a throttle, a crash), each of these jobs goes
-- alone next time. The job stays processing.
UPDATE app.embedding_jobs SET isolate = true
WHERE job_id = ANY(%(job_ids)s) AND status = 'processing' AND lease_owner = %(owner)s AND NOT isolate
RETURNING job_id, status

-- name: complete
-- changes.Complete: processing -> ready under this lease, only while a current chunk and an active
-- model want it, the vector stored and the call settled in the same statement; refused held jobs
-- become superseded (lost). Flushed before it returns (docs/decisions/0007-when-commits-wait.md).
WITH settled AS (
    UPDATE app.provider_calls
    SET outcome = %(outcome)s, http_status = %(http_status)s, latency_ms = %(latency_ms)s, billed = %(billed)s,
        tokens = coalesce(%(tokens)s, tokens), answered_at = clock_timestamp()
    WHERE call_id = %(call)s AND answered_at IS NULL
), won AS (
    UPDATE app.embedding_jobs j
    SET status = 'ready', lease_owner = NULL, lease_expires_at = NULL,
        error_class = NULL, error_message = NULL, updated_at = now()
    WHERE j.job_id = ANY(%(job_ids)s::bigint[])
      AND j.status = 'processing'
      AND j.lease_owner = %(owner)s
      AND EXISTS (SELECT 1 FROM app.chunks c WHERE c.chunk_checksum = j.chunk_checksum)
      AND EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = j.model_id AND m.active)
    RETURNING j.job_id, j.chunk_checksum, j.model_id, j.status
), stored AS (
    INSERT INTO app.embeddings (chunk_checksum, model_id, embedding)
    SELECT w.chunk_checksum, w.model_id, i.embedding
    FROM won w JOIN unnest(%(job_ids)s::bigint[], %(vectors)b::vector[]) AS i(job_id, embedding) USING (job_id)
    ON CONFLICT (chunk_checksum, model_id)
    DO UPDATE SET embedding = EXCLUDED.embedding, created_at = now()
), lost AS (
    UPDATE app.embedding_jobs j
    SET status = 'superseded', lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
    WHERE j.job_id = ANY (ARRAY(SELECT unnest(%(job_ids)s::bigint[]) EXCEPT SELECT job_id FROM won))
      AND j.status = 'processing' AND j.lease_owner = %(owner)s
    RETURNING j.job_id, j.status
)
SELECT job_id, status FROM won
UNION ALL
SELECT job_id, status FROM lost

-- name: supersede_held
-- changes.Supersede. processing -> superseded for a lease holder whose
-- content is no longer wanted (claimed jobs without text; complete supersedes
-- the held jobs it refuses for unwanted content itself).
UPDATE app.embedding_jobs
SET status = 'superseded', lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
WHERE job_id = ANY(%(job_ids)s) AND status = 'processing' AND lease_owner = %(owner)s
RETURNING job_id, status

-- name: fail_retryable
-- changes.Retry. processing -> retry (or failed when attempts are used up),
-- with a per-job delay; superseded when its model was retired meanwhile
-- (nobody would claim it again). The attempt the claim counted stays used.
UPDATE app.embedding_jobs j
SET status = CASE WHEN NOT EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = j.model_id AND m.active) THEN 'superseded'
                  WHEN j.attempts >= j.max_attempts THEN 'failed' ELSE 'retry' END,
    available_at = now() + make_interval(secs => d.delay),
    lease_owner = NULL, lease_expires_at = NULL,
    error_class = %(error_class)s, error_message = %(message)s, updated_at = now()
FROM unnest(%(job_ids)s::bigint[], %(delays)s::float8[]) AS d(job_id, delay)
WHERE j.job_id = d.job_id AND j.status = 'processing' AND j.lease_owner = %(owner)s
RETURNING j.job_id, j.status

-- name: give_back
-- changes.GiveBack: processing -> retry (pending without an earlier attempt), the attempt given
-- back: throttles, a request's transient fault, an unmatched answer, our own fault, shutdown.
-- Superseded instead when its model was retired meanwhile.
UPDATE app.embedding_jobs j
SET status = CASE WHEN NOT EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = j.model_id AND m.active) THEN 'superseded'
                  WHEN j.attempts <= 1 THEN 'pending' ELSE 'retry' END,
    attempts = greatest(j.attempts - 1, 0),
    throttles = j.throttles + CASE WHEN %(throttled)s THEN 1 ELSE 0 END,
    faults = j.faults + CASE WHEN %(faulted)s THEN 1 ELSE 0 END,
    available_at = now() + make_interval(secs => %(delay)s),
    lease_owner = NULL, lease_expires_at = NULL,
    error_class = coalesce(%(error_class)s, j.error_class),
    error_message = coalesce(%(message)s, j.error_message),
    updated_at = now()
WHERE j.job_id = ANY(%(job_ids)s) AND j.status = 'processing' AND j.lease_owner = %(owner)s
RETURNING j.job_id, j.status

-- name: fail_terminal
-- changes.Fail. processing -> failed at once: the input itself is bad.
UPDATE app.embedding_jobs
SET status = 'failed', lease_owner = NULL, lease_expires_at = NULL,
    error_class = %(error_class)s, error_message = %(message)s, updated_at = now()
WHERE job_id = ANY(%(job_ids)s) AND status = 'processing' AND lease_owner = %(owner)s
RETURNING job_id, status

-- name: extend_lease
-- Heartbeat: a healthy lease holder pushes its expiry forward.
UPDATE app.embedding_jobs
SET lease_expires_at = now() + make_interval(secs => %(lease)s)
WHERE job_id = ANY(%(job_ids)s) AND status = 'processing' AND lease_owner = %(owner)s

-- name: rescue_expired
-- Lease rescue: processing -> pending|retry when the lease expired or its worker is dead (silent
-- past alive_until while the rescuer could beat); the claim's fault: attempt given back, faults + 1,
-- except a lone suspect past %(free_faults)s faults (docs/state-machine.md, crashes and lease rescue).
WITH rescuer AS (
    SELECT r.alive_since, now() - (r.alive_until - r.beat_at) AS window_start FROM app.workers r
    WHERE r.owner_prefix = %(rescuer)s AND r.alive_until >= now()
), dead AS (
    SELECT w.owner_prefix FROM app.workers w, rescuer r
    WHERE w.alive_until < now() AND (r.alive_since <= w.alive_until OR r.alive_since <= r.window_start)
), judged AS (
    SELECT j.job_id, j.lease_owner, j.lease_expires_at < now() AS expired,
           j.faults >= %(free_faults)s
           AND count(*) OVER (PARTITION BY left(j.lease_owner, length(j.lease_owner)
                                                        - strpos(reverse(j.lease_owner), '/') + 1)) = 1 AS charged,
           NOT EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = j.model_id AND m.active) AS retired
    FROM app.embedding_jobs j
    WHERE j.status = 'processing'
      AND (j.lease_expires_at < now()
           OR EXISTS (SELECT 1 FROM dead d WHERE starts_with(j.lease_owner, d.owner_prefix)))
)
UPDATE app.embedding_jobs j
SET status = CASE WHEN g.retired THEN 'superseded'  -- its model was retired: nobody will claim it again
                  WHEN g.charged AND j.attempts >= j.max_attempts THEN 'failed'
                  WHEN g.charged OR j.attempts > 1 THEN 'retry' ELSE 'pending' END,
    attempts = CASE WHEN g.charged OR g.retired THEN j.attempts ELSE greatest(j.attempts - 1, 0) END,
    faults = CASE WHEN g.charged OR g.retired THEN j.faults ELSE j.faults + 1 END,
    lease_owner = NULL, lease_expires_at = NULL,
    available_at = now() + make_interval(secs => random() * least(%(cap)s, %(base)s * 2 ^ least(
        CASE WHEN g.charged THEN j.attempts ELSE j.faults + 1 END, 30))),
    error_class = why.error_class, error_message = why.error_message,
    updated_at = now()
FROM judged g
JOIN (VALUES (true, 'lease_expired', 'lease expired before completion (worker died or stalled)'),
             (false, 'worker_dead', 'its worker process stopped beating (died) before completion'))
     AS why(expired, error_class, error_message) ON why.expired = g.expired
WHERE j.job_id = g.job_id AND j.status = 'processing' AND j.lease_owner = g.lease_owner
RETURNING j.job_id, j.status

-- name: requeue_failed
-- failed -> pending (a person or policy requeues the dead letter); content that
-- is no longer wanted goes to superseded instead.
UPDATE app.embedding_jobs j
SET status = CASE WHEN EXISTS (SELECT 1 FROM app.chunks c WHERE c.chunk_checksum = j.chunk_checksum)
                       AND EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = j.model_id AND m.active)
                  THEN 'pending' ELSE 'superseded' END,
    attempts = 0, throttles = 0, faults = 0, available_at = now(), updated_at = now()
WHERE j.status = 'failed' AND (%(all)s OR j.job_id = ANY(%(ids)s))
RETURNING j.job_id, j.status

-- name: supersede_unwanted
-- pending|retry|processing|ready|failed -> superseded when no current chunk carries the checksum.
-- The vectors go in a separate statement (delete_vectors), whose newer snapshot sees a completion
-- that committed while this UPDATE waited.
UPDATE app.embedding_jobs j
SET status = 'superseded', lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
WHERE j.status IN ('pending', 'retry', 'processing', 'ready', 'failed')
  AND NOT EXISTS (SELECT 1 FROM app.chunks c WHERE c.chunk_checksum = j.chunk_checksum)
RETURNING j.chunk_checksum, j.model_id

-- name: supersede_unwanted_among
-- supersede_unwanted limited to some checksums (the ones an ingest batch just
-- dropped). Its vectors, too, go through delete_vectors.
UPDATE app.embedding_jobs j
SET status = 'superseded', lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
FROM app.job_keys k
WHERE k.chunk_checksum = ANY(%(checksums)s::bytea[]) AND j.job_id = k.job_id
  AND j.status IN ('pending', 'retry', 'processing', 'ready', 'failed')
  AND NOT EXISTS (SELECT 1 FROM app.chunks c WHERE c.chunk_checksum = j.chunk_checksum)
RETURNING j.chunk_checksum, j.model_id

-- name: delete_vectors
-- The vectors of the (checksum, model) pairs supersede_unwanted* just moved.
DELETE FROM app.embeddings e
USING unnest(%(checksums)s::bytea[], %(models)s::text[]) AS g(chunk_checksum, model_id)
WHERE e.chunk_checksum = g.chunk_checksum AND e.model_id = g.model_id

-- name: enqueue
-- New work: every current chunk x active model in a scope (enqueue_scope_*) without a job. Known
-- keys are filtered out first; the identity is claimed in app.job_keys, so a racing ingest's key
-- creates no state row.
WITH wanted AS (
    SELECT DISTINCT c.chunk_checksum, m.model_id
    FROM app.chunks c CROSS JOIN app.models m
    WHERE m.active AND {scope}
      AND NOT EXISTS (SELECT 1 FROM app.job_keys k WHERE k.chunk_checksum = c.chunk_checksum
                                                     AND k.model_id = m.model_id)
), keyed AS (
    INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)
    SELECT w.chunk_checksum, w.model_id, nextval(pg_get_serial_sequence('app.embedding_jobs', 'job_id'))
    FROM wanted w
    ON CONFLICT (chunk_checksum, model_id) DO NOTHING
    RETURNING chunk_checksum, model_id, job_id
)
INSERT INTO app.embedding_jobs (job_id, chunk_checksum, model_id, max_attempts)
OVERRIDING SYSTEM VALUE
SELECT job_id, chunk_checksum, model_id, %(max_attempts)s FROM keyed

-- name: enqueue_docs
-- The chunks of some documents (a rerun, a vector wait): a job per active model without one. As
-- enqueue_chunks, OFFSET 0 keeps each key's probe an index lookup, never a scan of job_keys.
WITH wanted AS (
    SELECT DISTINCT c.chunk_checksum, m.model_id
    FROM app.chunks c CROSS JOIN app.models m
    WHERE m.active AND c.doc_pk = ANY(%(docs)s::bigint[])
      AND NOT EXISTS (SELECT 1 FROM app.job_keys k WHERE k.chunk_checksum = c.chunk_checksum
                                                     AND k.model_id = m.model_id OFFSET 0)
), keyed AS (
    INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)
    SELECT w.chunk_checksum, w.model_id, nextval(pg_get_serial_sequence('app.embedding_jobs', 'job_id'))
    FROM wanted w
    ON CONFLICT (chunk_checksum, model_id) DO NOTHING
    RETURNING chunk_checksum, model_id, job_id
)
INSERT INTO app.embedding_jobs (job_id, chunk_checksum, model_id, max_attempts)
OVERRIDING SYSTEM VALUE
SELECT job_id, chunk_checksum, model_id, %(max_attempts)s FROM keyed

-- name: enqueue_chunks
-- The distinct checksums of chunks this transaction wrote: a job per active model without one, superseded
-- ones revived; returns (enqueued, revived). OFFSET 0 keeps each key's probe an index lookup (a subplan),
-- never a scan of job_keys, whatever the statistics (a first ingest has none).
WITH wanted AS (
    SELECT c.chunk_checksum, m.model_id
    FROM unnest(%(checksums)s::bytea[]) AS c(chunk_checksum) CROSS JOIN app.models m
    WHERE m.active
      AND NOT EXISTS (SELECT 1 FROM app.job_keys k WHERE k.chunk_checksum = c.chunk_checksum
                                                     AND k.model_id = m.model_id OFFSET 0)
), keyed AS (
    INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)
    SELECT w.chunk_checksum, w.model_id, nextval(pg_get_serial_sequence('app.embedding_jobs', 'job_id'))
    FROM wanted w
    ON CONFLICT (chunk_checksum, model_id) DO NOTHING
    RETURNING chunk_checksum, model_id, job_id
), enqueued AS (
    INSERT INTO app.embedding_jobs (job_id, chunk_checksum, model_id, max_attempts)
    OVERRIDING SYSTEM VALUE
    SELECT job_id, chunk_checksum, model_id, %(max_attempts)s FROM keyed
    RETURNING 1
), revived AS (
    UPDATE app.embedding_jobs j
    SET status = 'pending', attempts = 0, throttles = 0, faults = 0, available_at = now(),
        error_class = NULL, error_message = NULL, updated_at = now()
    FROM app.job_keys k
    WHERE k.chunk_checksum = ANY(%(checksums)s::bytea[]) AND j.job_id = k.job_id
      AND j.status = 'superseded'
      AND EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = j.model_id AND m.active)
    RETURNING 1
)
SELECT (SELECT count(*) FROM enqueued), (SELECT count(*) FROM revived)

-- name: enqueue_scope_missing
-- Every chunk whose key is missing (reconcile, a model seen for the first time):
-- the statement itself leaves out the chunks that have one.
true

-- name: revive_wanted
-- superseded -> pending: content came back (a revert, a re-added file).
UPDATE app.embedding_jobs j
SET status = 'pending', attempts = 0, throttles = 0, faults = 0, available_at = now(),
    error_class = NULL, error_message = NULL, updated_at = now()
WHERE j.status = 'superseded'
  AND EXISTS (SELECT 1 FROM app.chunks c WHERE c.chunk_checksum = j.chunk_checksum)
  AND EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = j.model_id AND m.active)

-- name: revive_wanted_among
-- revive_wanted limited to some checksums.
UPDATE app.embedding_jobs j
SET status = 'pending', attempts = 0, throttles = 0, faults = 0, available_at = now(),
    error_class = NULL, error_message = NULL, updated_at = now()
FROM app.job_keys k
WHERE k.chunk_checksum = ANY(%(checksums)s::bytea[]) AND j.job_id = k.job_id
  AND j.status = 'superseded'
  AND EXISTS (SELECT 1 FROM app.chunks c WHERE c.chunk_checksum = j.chunk_checksum)
  AND EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = j.model_id AND m.active)

-- name: supersede_retired_model
-- pending|retry -> superseded for a model that was just retired (models.retire):
-- nobody will claim them again. Held and ready jobs are left alone (a late
-- completion is refused by complete: the model is inactive).
UPDATE app.embedding_jobs SET status = 'superseded', updated_at = now()
WHERE model_id = %(model)s AND status IN ('pending', 'retry')

-- name: drop_orphan_keys
-- An identity whose state row was lost (a manual DELETE, a restore) would block
-- re-enqueueing that content forever; drop it so enqueue_missing can recreate both.
DELETE FROM app.job_keys k
WHERE NOT EXISTS (SELECT 1 FROM app.embedding_jobs j WHERE j.job_id = k.job_id)

-- name: repair_missing_vectors
-- ready -> pending: the job says ready but its vector is missing.
UPDATE app.embedding_jobs j
SET status = 'pending', attempts = 0, available_at = now(), updated_at = now()
WHERE j.status = 'ready'
  AND EXISTS (SELECT 1 FROM app.models m WHERE m.model_id = j.model_id AND m.active)
  AND NOT EXISTS (SELECT 1 FROM app.embeddings e
                  WHERE e.chunk_checksum = j.chunk_checksum AND e.model_id = j.model_id)

-- name: outstanding
-- Is anything left for this model (until-idle)? Two probes, each on a partial index; "waiting" is
-- a min() over the claim index, not an EXISTS (docs/decisions/0008-plan-stable-statements.md).
SELECT (SELECT min(available_at) FROM app.embedding_jobs
        WHERE model_id = %(model)s AND status IN ('pending', 'retry')) IS NOT NULL AS waiting,
       EXISTS (SELECT 1 FROM app.embedding_jobs WHERE status = 'processing' AND model_id = %(model)s) AS held

-- name: provider_failure
-- A provider failure shared by every worker: `trip` trips the breaker at once, the worker's
-- failures after `threshold` in a row; the pause is the Retry-After, else equal jitter capped at
-- probe_cap. A failure while tripped frees the probe slot.
INSERT INTO app.provider_state AS p (model_id, consecutive_failures, tripped, paused_until)
VALUES (%(model)s, 1, %(trip)s OR 1 >= %(threshold)s,
        CASE WHEN %(trip)s OR 1 >= %(threshold)s
             THEN now() + make_interval(secs => CASE WHEN %(floor)s > 0 THEN %(floor)s
                                                     ELSE (0.5 + random() / 2) * least(%(probe_cap)s, %(cap)s, %(base)s * 2) END)
             ELSE '-infinity' END)
ON CONFLICT (model_id) DO UPDATE
SET consecutive_failures = p.consecutive_failures + 1,
    tripped = p.tripped OR %(trip)s OR p.consecutive_failures + 1 >= %(threshold)s,
    paused_until = CASE WHEN %(trip)s OR p.consecutive_failures + 1 >= %(threshold)s
                        THEN greatest(p.paused_until, now() + make_interval(secs => CASE
                             WHEN %(floor)s > 0 THEN %(floor)s
                             ELSE (0.5 + random() / 2) * least(%(probe_cap)s, %(cap)s,
                                                              %(base)s * 2 ^ least(p.consecutive_failures + 1, 30))
                             END))
                        ELSE p.paused_until END,
    probe_until = CASE WHEN p.tripped OR %(trip)s OR p.consecutive_failures + 1 >= %(threshold)s
                       THEN '-infinity' ELSE p.probe_until END,
    probe_owner = CASE WHEN p.tripped OR %(trip)s OR p.consecutive_failures + 1 >= %(threshold)s
                       THEN NULL ELSE p.probe_owner END,
    updated_at = now()
RETURNING paused_until > now() AS paused, tripped, consecutive_failures

-- name: provider_pause
-- A throttle (429) shared by every worker: nobody claims until the Retry-After (or a short
-- full-jitter pause, at most probe_cap); the breaker does not trip, no failure is counted.
INSERT INTO app.provider_state AS p (model_id, paused_until)
VALUES (%(model)s, now() + make_interval(secs => CASE WHEN %(floor)s > 0 THEN %(floor)s
                                                     ELSE random() * least(%(probe_cap)s, %(cap)s, %(base)s * 2) END))
ON CONFLICT (model_id) DO UPDATE SET paused_until = greatest(p.paused_until, excluded.paused_until),
                                     updated_at = now()

-- name: provider_healthy
-- A success closes the breaker and resets the failure count.
UPDATE app.provider_state SET consecutive_failures = 0, tripped = false, probe_until = '-infinity',
       probe_owner = NULL, updated_at = now()
WHERE model_id = %(model)s AND (consecutive_failures <> 0 OR tripped)
  AND (NOT tripped OR paused_until <= now())  -- a call that was already in flight cannot cut a pause short

-- name: provider_unusable
-- An answer with nothing usable even to a single trivial input: counted for
-- every worker and kept across restarts; returns how many came in a row.
INSERT INTO app.provider_state AS p (model_id, unusable_answers) VALUES (%(model)s, 1)
ON CONFLICT (model_id) DO UPDATE SET unusable_answers = p.unusable_answers + 1, updated_at = now()
RETURNING unusable_answers

-- name: provider_unusable_count
-- How many answers in a row held nothing usable, even to a single trivial input.
SELECT unusable_answers FROM app.provider_state WHERE model_id = %(model)s

-- name: provider_usable
-- A usable answer resets the unusable answers in a row.
UPDATE app.provider_state SET unusable_answers = 0, updated_at = now()
WHERE model_id = %(model)s AND unusable_answers <> 0
