-- The spend ledger (pipeline_assets/jobs/ledger.py): app.provider_calls and
-- app.input_sends. app.input_sends.sends counts the sends of an input that were
-- or may have been billed; more than one is duplicate spend.

-- name: record_send
-- Before the request goes out, committed on its own: the call row (outcome
-- 'sent', possibly billed, the estimated tokens) and one more send of each input.
-- One statement, so one implicit transaction (a single round trip, no BEGIN or
-- COMMIT), which commits without waiting for its WAL flush (synchronous_commit
-- off for this transaction only, set_config(..., true)): visible to every
-- session at once and kept if the worker dies, lost only if the database
-- server itself crashes within about 3 x wal_writer_delay (0.6 s by default)
-- and no later commit flushed it. It spares every provider request a disk flush.
WITH async AS (
    SELECT set_config('synchronous_commit', 'off', true)
), call AS (
    INSERT INTO app.provider_calls (model_id, worker_id, worker_run, inputs, tokens, outcome, http_status,
                                    latency_ms, billed, called_at)
    VALUES (%(model)s, %(worker)s, %(run)s, cardinality(%(checksums)b::bytea[]), %(tokens)s, 'sent', NULL, 0,
            'maybe', clock_timestamp())
    RETURNING call_id
), sent AS (
    INSERT INTO app.input_sends (chunk_checksum, model_id, sends)
    SELECT c, %(model)s, 1 FROM unnest(%(checksums)b::bytea[]) AS c
    ON CONFLICT (chunk_checksum, model_id) DO UPDATE SET sends = app.input_sends.sends + 1
)
SELECT call_id FROM call, async

-- name: record_outcome
-- After the answer (or the error): settle the call once. billed 'no' (the
-- provider refused the request) takes its sends back; 'yes' and 'maybe' keep
-- them (and are given no checksums: ledger.record_outcome). tokens NULL keeps
-- the estimate recorded with the send.
WITH settled AS (
    UPDATE app.provider_calls
    SET outcome = %(outcome)s, http_status = %(status)s, latency_ms = %(latency)s, billed = %(billed)s,
        tokens = coalesce(%(tokens)s, tokens), answered_at = clock_timestamp()
    WHERE call_id = %(call)s AND answered_at IS NULL
    RETURNING billed
)
UPDATE app.input_sends s SET sends = s.sends - 1
WHERE s.model_id = %(model)s AND s.chunk_checksum = ANY(%(checksums)b::bytea[])
  AND EXISTS (SELECT 1 FROM settled WHERE settled.billed = 'no')

-- name: record_call
-- A call recorded after the fact in one statement (no send row before it): the
-- call row and, when it may have been billed, one more send of each input.
WITH call AS (
    INSERT INTO app.provider_calls (model_id, worker_id, inputs, tokens, outcome, http_status, latency_ms,
                                    billed, called_at, answered_at)
    VALUES (%(model)s, %(worker)s, cardinality(%(checksums)s::bytea[]), %(tokens)s, %(outcome)s,
            %(status)s, %(latency)s, CASE WHEN NOT %(billed)s THEN 'no' WHEN %(outcome)s = 'ok' THEN 'yes'
                                          ELSE 'maybe' END,
            clock_timestamp() - make_interval(secs => %(latency)s / 1000.0), clock_timestamp())
)
INSERT INTO app.input_sends (chunk_checksum, model_id, sends)
SELECT c, %(model)s, 1 FROM unnest(%(checksums)s::bytea[]) AS c WHERE %(billed)s
ON CONFLICT (chunk_checksum, model_id) DO UPDATE SET sends = app.input_sends.sends + 1

-- name: tokens_today
-- Tokens billed (or possibly billed: calls without an answer count their
-- estimate) for the model since midnight UTC, except those of one worker run
-- (NULL: none excepted), which counts its own as they are answered.
SELECT coalesce(sum(tokens), 0) AS tokens FROM app.provider_calls
WHERE model_id = %(model)s AND called_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
  AND (%(run)s::text IS NULL OR worker_run IS DISTINCT FROM %(run)s)
