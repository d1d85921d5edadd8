-- The spend ledger records each send BEFORE the request goes out, in its own
-- short transaction, and its outcome after (pipeline_assets/jobqueue/ledger.py).
--
-- A call row starts as outcome 'sent', billed 'maybe', with the estimated
-- tokens of its inputs, and each input's send is counted in app.input_sends at
-- once. The outcome then settles it: 'ok' (billed 'yes', the provider's usage),
-- an ambiguous failure (timeout, dropped connection: billed 'maybe', the
-- estimate kept) or a refusal (429, 5xx, 4xx: billed 'no', no tokens, and the
-- sends are taken back). A worker killed mid-call leaves its row 'sent' with
-- answered_at NULL: the send is still counted as possibly billed.
ALTER TABLE app.provider_calls
    ADD COLUMN billed      text NOT NULL DEFAULT 'maybe' CHECK (billed IN ('yes', 'maybe', 'no')),
    ADD COLUMN answered_at timestamptz,   -- NULL: no outcome recorded (in flight, or the worker died)
    ADD COLUMN worker_run  text;          -- the worker run that sent it (its lease-owner prefix)

-- Rows written before this migration were written after their answer.
UPDATE app.provider_calls
SET billed = CASE WHEN outcome = 'ok' THEN 'yes'
                  WHEN outcome IN ('timeout', 'connection') THEN 'maybe' ELSE 'no' END,
    answered_at = called_at + make_interval(secs => latency_ms / 1000.0);
