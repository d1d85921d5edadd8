-- Ingests in progress (pipeline_assets/jobqueue/running_ingests.py): app.running_ingests.

-- name: begin
-- An ingest starts: alive until now() + alive_for; rows of ingests dead for a day are forgotten.
WITH forgotten AS (DELETE FROM app.running_ingests WHERE alive_until < now() - interval '1 day')
INSERT INTO app.running_ingests (ingest_id, host, pid, alive_until)
VALUES (%(ingest)s, %(host)s, %(pid)s, now() + make_interval(secs => %(alive_for)s))

-- name: beat
-- A running ingest's beat: alive until now() + alive_for.
UPDATE app.running_ingests SET alive_until = now() + make_interval(secs => %(alive_for)s)
WHERE ingest_id = %(ingest)s

-- name: finish
-- An ingest ends (whatever its outcome).
DELETE FROM app.running_ingests WHERE ingest_id = %(ingest)s

-- name: any_running
-- Whether an ingest is running (a row still alive).
SELECT EXISTS (SELECT 1 FROM app.running_ingests WHERE alive_until > now())
