-- The dead-letter queue as a work list: a bounded per-attempt
-- history of every job that met a failure, and the record of who gave up on
-- which dead letter and why (pipeline_assets/app/dlq.py, sql/queries/dlq.sql).
--
-- The history is written by a trigger, not by the worker: the worker's
-- statements (sql/queries/jobs.sql) are untouched, and the trigger's WHEN
-- clause is false on the ordinary path (pending|retry -> processing -> ready,
-- processing -> superseded), so a claim or a completion queues no trigger
-- event and runs no function: it pays one comparison of OLD.status per row.
-- It fires on:
--   processing -> retry | pending | failed that used an attempt (retryable
--     failure, terminal failure, lease rescue), counted a throttle, or brought
--     a new error (a fault of our own given back); a plain give-back without
--     an error (shutdown, the rest of a throttled batch) is not recorded;
--   failed -> anything (requeued, superseded): the dead letter's discard, if
--     any, is lifted, since a later failure is new information.

-- ATTEMPTS_KEPT_PER_JOB: history rows kept per job (the newest). Bounds the
-- table at this many rows per job, however often a job fails or is requeued.
-- pipeline_assets/app/dlq.py holds the same number (a test compares them).
CREATE FUNCTION app.job_attempts_kept() RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT 20';

CREATE TABLE app.job_attempts (
    attempt_id    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- order of events
    job_id        bigint NOT NULL,
    recorded_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor         text,            -- the claim's lease owner (worker-id/uuid/seq), or the person (requeue, discard)
    attempt       int NOT NULL,    -- the job's attempt number when it happened
    outcome       text NOT NULL,   -- retry | failed | rescued | throttled | given_back | requeued | superseded | discarded
    status        text NOT NULL,   -- the job's status after it
    error_class   text,
    error_message text             -- as stored on the job: already sanitized by the worker
);
CREATE INDEX job_attempts_job ON app.job_attempts (job_id, attempt_id);

-- Dead letters a person gave up on. A discarded item stays failed (or
-- quarantined) but leaves the work list, `requeue --all` / `--error-class`
-- and the dead-letter growth check. One row per item while it is a dead
-- letter: lifted when the job leaves `failed` or the document leaves
-- quarantine (or is quarantined again for another reason or other bytes).
CREATE TABLE app.dlq_discards (
    discard_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id       bigint UNIQUE,
    doc_pk       bigint UNIQUE REFERENCES app.documents ON DELETE CASCADE,
    error_class  text,             -- the item's error class when discarded
    discarded_by text NOT NULL,
    reason       text NOT NULL,    -- sanitized and truncated like any stored error message
    discarded_at timestamptz NOT NULL DEFAULT now(),
    CHECK (num_nonnulls(job_id, doc_pk) = 1)
);

CREATE FUNCTION app.trim_job_attempts(job bigint) RETURNS void LANGUAGE sql AS $$
    DELETE FROM app.job_attempts
    WHERE job_id = job AND attempt_id <= (SELECT a.attempt_id FROM app.job_attempts a WHERE a.job_id = job
                                          ORDER BY a.attempt_id DESC OFFSET app.job_attempts_kept() LIMIT 1)
$$;

CREATE FUNCTION app.record_job_attempt() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    happened text;
BEGIN
    IF OLD.status = 'failed' THEN
        happened := CASE WHEN NEW.status = 'pending' THEN 'requeued' ELSE NEW.status END;
        DELETE FROM app.dlq_discards WHERE job_id = NEW.job_id;
    ELSIF NEW.throttles > OLD.throttles THEN happened := 'throttled';
    ELSIF NEW.attempts < OLD.attempts THEN happened := 'given_back';
    ELSIF NEW.error_class IN ('lease_expired', 'worker_dead') THEN happened := 'rescued';
    ELSE happened := NEW.status;  -- retry | failed
    END IF;
    INSERT INTO app.job_attempts (job_id, actor, attempt, outcome, status, error_class, error_message)
    VALUES (NEW.job_id, coalesce(OLD.lease_owner, nullif(current_setting('pipeline.actor', true), '')),
            OLD.attempts, happened, NEW.status, NEW.error_class, NEW.error_message);
    PERFORM app.trim_job_attempts(NEW.job_id);
    RETURN NULL;
END $$;

CREATE TRIGGER embedding_jobs_attempt_history
AFTER UPDATE OF status ON app.embedding_jobs
FOR EACH ROW
WHEN ((OLD.status = 'processing' AND NEW.status IN ('retry', 'pending', 'failed')
       AND (NEW.attempts >= OLD.attempts OR NEW.throttles > OLD.throttles
            OR NEW.error_class IS DISTINCT FROM OLD.error_class
            OR NEW.error_message IS DISTINCT FROM OLD.error_message))
      OR (OLD.status = 'failed' AND NEW.status <> 'failed'))
EXECUTE FUNCTION app.record_job_attempt();

-- A job that is deleted (a repair, a restore) or truncated takes its history
-- and its discard along: no orphan rows (no foreign key, which would add a
-- check to every job transition).
CREATE FUNCTION app.forget_deleted_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM app.job_attempts a USING gone g WHERE a.job_id = g.job_id;
    DELETE FROM app.dlq_discards d USING gone g WHERE d.job_id = g.job_id;
    RETURN NULL;
END $$;
CREATE TRIGGER embedding_jobs_forget_deleted
AFTER DELETE ON app.embedding_jobs REFERENCING OLD TABLE AS gone
FOR EACH STATEMENT EXECUTE FUNCTION app.forget_deleted_jobs();

CREATE FUNCTION app.forget_truncated_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE app.job_attempts;
    DELETE FROM app.dlq_discards WHERE job_id IS NOT NULL;
    RETURN NULL;
END $$;
CREATE TRIGGER embedding_jobs_forget_truncated
AFTER TRUNCATE ON app.embedding_jobs
FOR EACH STATEMENT EXECUTE FUNCTION app.forget_truncated_jobs();

-- A quarantined document's discard is lifted when it leaves quarantine, or is
-- quarantined again for another reason or with other bytes.
CREATE FUNCTION app.lift_document_discard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM app.dlq_discards WHERE doc_pk = NEW.doc_pk;
    RETURN NULL;
END $$;
CREATE TRIGGER documents_lift_discard
AFTER UPDATE ON app.documents
FOR EACH ROW
WHEN (OLD.status = 'quarantined'
      AND (NEW.status <> 'quarantined' OR NEW.error_class IS DISTINCT FROM OLD.error_class
           OR NEW.source_checksum IS DISTINCT FROM OLD.source_checksum))
EXECUTE FUNCTION app.lift_document_discard();
