-- A rescued claim (a dead or stalled worker) is a fault of the claim: each job
-- gets its attempt back and counts a fault (jobs.sql rescue_expired). The
-- attempt history still calls it a rescue: the rescue's error class is told
-- before the give-back's fewer attempts, and every rescue is recorded, also a
-- job's second in a row with the same error (its fault count grows).
CREATE OR REPLACE FUNCTION app.record_job_attempt() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    happened text;
BEGIN
    IF OLD.status = 'failed' THEN
        happened := CASE WHEN NEW.status = 'pending' THEN 'requeued' ELSE NEW.status END;
        DELETE FROM app.dlq_discards WHERE job_id = NEW.job_id;
    ELSIF NEW.throttles > OLD.throttles THEN happened := 'throttled';
    ELSIF NEW.error_class IN ('lease_expired', 'worker_dead')
          AND (NEW.faults > OLD.faults OR NEW.attempts >= OLD.attempts) THEN happened := 'rescued';
    ELSIF NEW.attempts < OLD.attempts THEN happened := 'given_back';
    ELSE happened := NEW.status;  -- retry | failed
    END IF;
    INSERT INTO app.job_attempts (job_id, actor, attempt, outcome, status, error_class, error_message)
    VALUES (NEW.job_id, coalesce(OLD.lease_owner, nullif(current_setting('pipeline.actor', true), '')),
            OLD.attempts, happened, NEW.status, NEW.error_class, NEW.error_message);
    PERFORM app.trim_job_attempts(NEW.job_id);
    RETURN NULL;
END $$;

DROP TRIGGER embedding_jobs_attempt_history ON app.embedding_jobs;
CREATE TRIGGER embedding_jobs_attempt_history
AFTER UPDATE OF status ON app.embedding_jobs
FOR EACH ROW
WHEN ((OLD.status = 'processing' AND NEW.status IN ('retry', 'pending', 'failed')
       AND (NEW.attempts >= OLD.attempts OR NEW.throttles > OLD.throttles OR NEW.faults > OLD.faults
            OR NEW.error_class IS DISTINCT FROM OLD.error_class
            OR NEW.error_message IS DISTINCT FROM OLD.error_message))
      OR (OLD.status = 'failed' AND NEW.status <> 'failed'))
EXECUTE FUNCTION app.record_job_attempt();
