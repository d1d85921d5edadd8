-- The sends of each input are counted from the calls that sent them.
--
-- Until now record_send upserted one app.input_sends row per input of every
-- request: a heap tuple, a primary-key entry and a speculative-insert
-- confirmation per input sent, about 15 us of the database's time per job of
-- a worker's cycle (an eighth of it). The ledger already has one row per call:
-- the call now carries the checksums of its inputs (one array, written once),
-- and app.input_sends becomes a view that counts them. Its meaning is
-- unchanged: the sends of an input that were or may have been billed, per
-- (content, model); a refused call (billed 'no') counts nothing, so a refusal
-- no longer has to take sends back. Counts written before this migration stay
-- in app.input_sends_until_032 and are added in.
ALTER TABLE app.provider_calls ADD COLUMN checksums bytea[];  -- the inputs sent; NULL before 032
-- Hashes do not compress: store the array as is (no compression attempt per call).
ALTER TABLE app.provider_calls ALTER COLUMN checksums SET STORAGE EXTERNAL;

ALTER TABLE app.input_sends RENAME TO input_sends_until_032;
ALTER TABLE app.input_sends_until_032 RENAME CONSTRAINT input_sends_pkey TO input_sends_until_032_pkey;

-- One aggregation over the calls' inputs (and the counts from before 032).
CREATE VIEW app.input_sends AS
SELECT chunk_checksum, model_id, sum(sends)::int AS sends
FROM (SELECT s.chunk_checksum, c.model_id, 1 AS sends
      FROM app.provider_calls c CROSS JOIN LATERAL unnest(c.checksums) AS s(chunk_checksum)
      WHERE c.billed <> 'no'
      UNION ALL
      SELECT chunk_checksum, model_id, sends FROM app.input_sends_until_032) AS sent
GROUP BY chunk_checksum, model_id;
