-- The spend ledger (pipeline_assets/jobs/ledger.py): app.provider_calls and
-- app.input_sends.

-- name: record_call
-- One statement per call: the call row, and (when it may have been billed) one
-- more send of each input.
WITH call AS (
    INSERT INTO app.provider_calls (model_id, worker_id, inputs, tokens, outcome, http_status, latency_ms,
                                    called_at)
    VALUES (%(model)s, %(worker)s, cardinality(%(checksums)s::bytea[]), %(tokens)s, %(outcome)s,
            %(status)s, %(latency)s, clock_timestamp() - make_interval(secs => %(latency)s / 1000.0))
)
INSERT INTO app.input_sends (chunk_checksum, model_id, sends)
SELECT c, %(model)s, 1 FROM unnest(%(checksums)s::bytea[]) AS c WHERE %(billed)s
ON CONFLICT (chunk_checksum, model_id) DO UPDATE SET sends = app.input_sends.sends + 1

-- name: tokens_today
-- Tokens billed for the model since midnight UTC.
SELECT coalesce(sum(tokens), 0) AS tokens FROM app.provider_calls
WHERE model_id = %(model)s AND called_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
