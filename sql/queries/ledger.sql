-- The spend ledger (jobqueue/ledger.py): app.provider_calls, one row per call with its inputs'
-- checksums; the view app.input_sends counts each input's billed or possibly billed sends.

-- name: record_send
-- Before the request goes out: the call row ('sent', possibly billed, estimated tokens, inputs'
-- checksums), one statement committed without waiting for its WAL flush
-- (docs/decisions/0007-when-commits-wait.md).
WITH async AS (
    SELECT set_config('synchronous_commit', 'off', true)
)
INSERT INTO app.provider_calls (model_id, worker_id, worker_run, inputs, checksums, tokens, outcome, http_status,
                                latency_ms, billed, called_at)
SELECT %(model)s, %(worker)s, %(worker_run)s, cardinality(%(checksums)b::bytea[]), %(checksums)b::bytea[], %(tokens)s,
       'sent', NULL, 0, 'maybe', clock_timestamp()
FROM async
RETURNING call_id

-- name: record_outcome
-- After the answer (or the error): settle the call once; billed 'no' (refused) takes its sends back.
-- tokens NULL keeps the estimate recorded with the send.
UPDATE app.provider_calls
SET outcome = %(outcome)s, http_status = %(status)s, latency_ms = %(latency)s, billed = %(billed)s,
    tokens = coalesce(%(tokens)s, tokens), answered_at = clock_timestamp()
WHERE call_id = %(call)s AND answered_at IS NULL

-- name: record_call
-- A call recorded after the fact in one statement (no send row before it),
-- with its inputs; when it was not billed, they count no send.
INSERT INTO app.provider_calls (model_id, worker_id, inputs, checksums, tokens, outcome, http_status, latency_ms,
                                billed, called_at, answered_at)
VALUES (%(model)s, %(worker)s, cardinality(%(checksums)s::bytea[]), %(checksums)s::bytea[], %(tokens)s,
        %(outcome)s, %(status)s, %(latency)s,
        CASE WHEN NOT %(billed)s THEN 'no' WHEN %(outcome)s = 'ok' THEN 'yes' ELSE 'maybe' END,
        clock_timestamp() - make_interval(secs => %(latency)s / 1000.0), clock_timestamp())

-- name: tokens_today
-- Tokens billed (or possibly billed: calls without an answer count their
-- estimate) for the model since midnight UTC, except those of one worker run
-- (NULL: none excepted), which counts its own as they are answered.
SELECT coalesce(sum(tokens), 0) AS tokens FROM app.provider_calls
WHERE model_id = %(model)s AND called_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
  AND (%(worker_run)s::text IS NULL OR worker_run IS DISTINCT FROM %(worker_run)s)
