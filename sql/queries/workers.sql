-- Worker liveness (pipeline_assets/jobqueue/leases.py): app.workers. The rescue of
-- a dead worker's claims is jobs.sql's rescue_expired.

-- name: beat
-- Register or refresh a worker: alive until now() + dead_after. A beat after a
-- gap (its previous deadline passed) restarts alive_since: a worker that was
-- silent may not judge others dead until it has been beating for a while.
INSERT INTO app.workers AS w (owner_prefix, worker_id, model_id, host, pid, alive_until)
VALUES (%(prefix)s, %(worker)s, %(model)s, %(host)s, %(pid)s, now() + make_interval(secs => %(dead_after)s))
ON CONFLICT (owner_prefix) DO UPDATE
SET alive_since = CASE WHEN w.alive_until < now() THEN now() ELSE w.alive_since END,
    beat_at = now(),
    alive_until = now() + make_interval(secs => %(dead_after)s)

-- name: leave
-- A worker that stops cleanly (its claims handed back) leaves.
DELETE FROM app.workers WHERE owner_prefix = %(prefix)s

-- name: forget_dead
-- Rows of workers dead for longer than `keep` seconds and holding no claim.
DELETE FROM app.workers w
WHERE w.alive_until < now() - make_interval(secs => %(keep)s)
  AND NOT EXISTS (SELECT 1 FROM app.embedding_jobs j
                  WHERE j.status = 'processing' AND starts_with(j.lease_owner, w.owner_prefix))
