-- 1. The embed row of app.stage_runs is per document AND model.
--
-- Keyed (doc_pk, stage), a document had one embed row: with two active models
-- it flipped to whichever model was refreshed last. model_id is '' for the
-- model-independent stages (extract, chunk: a primary key column cannot be
-- NULL) and the model for embed; the CHECK keeps the two apart.
ALTER TABLE app.stage_runs ADD COLUMN model_id text NOT NULL DEFAULT '';
-- The embed rows written so far carried their model as code_version.
UPDATE app.stage_runs SET model_id = coalesce(code_version, '') WHERE stage = 'embed';
DELETE FROM app.stage_runs WHERE stage = 'embed' AND model_id = '';
ALTER TABLE app.stage_runs
    DROP CONSTRAINT stage_runs_pkey,
    ADD PRIMARY KEY (doc_pk, stage, model_id),
    ADD CONSTRAINT stage_runs_model_only_for_embed CHECK ((stage = 'embed') = (model_id <> ''));

-- A work run refreshes only the embed rows of the documents it touched: the
-- checksums whose vectors it stored are found by time, through this index
-- (app.embeddings is written once per completion; the job table's narrow
-- indexes are left alone).
CREATE INDEX embeddings_model_created ON app.embeddings (model_id, created_at);

-- 2. app.job_keys and app.embedding_jobs are one-to-one, in the schema.
--
-- 003 moved the job identity to app.job_keys; nothing tied the two rows
-- together, so a lost state row left a key that blocked re-enqueueing its
-- content, and a lost key left a job nobody could find by content. Now every
-- key references its job and every job its key. The foreign keys are
-- DEFERRABLE INITIALLY DEFERRED: enqueue inserts the key and the job in one
-- statement, and a transaction that deletes one must delete the other before
-- it commits. (Updates of the job row never change job_id, so the job state
-- transitions fire no check.)
LOCK TABLE app.job_keys, app.embedding_jobs IN SHARE ROW EXCLUSIVE MODE;
-- Repair what the old schema allowed, so the constraints validate: keys whose
-- job is gone or names other content (enqueue recreates both when the content
-- is wanted), jobs without a key (a key is restored from the job's own
-- identity unless another job holds it: that job is a duplicate and goes).
DELETE FROM app.job_keys k
WHERE NOT EXISTS (SELECT 1 FROM app.embedding_jobs j
                  WHERE j.job_id = k.job_id AND j.chunk_checksum = k.chunk_checksum
                    AND j.model_id = k.model_id);
INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)
SELECT j.chunk_checksum, j.model_id, j.job_id FROM app.embedding_jobs j
WHERE NOT EXISTS (SELECT 1 FROM app.job_keys k WHERE k.job_id = j.job_id)
ORDER BY j.job_id
ON CONFLICT (chunk_checksum, model_id) DO NOTHING;
DELETE FROM app.embedding_jobs j WHERE NOT EXISTS (SELECT 1 FROM app.job_keys k WHERE k.job_id = j.job_id);

ALTER TABLE app.job_keys
    ADD CONSTRAINT job_keys_job_id_key UNIQUE (job_id),
    ADD CONSTRAINT job_keys_job_id_fkey FOREIGN KEY (job_id) REFERENCES app.embedding_jobs (job_id)
        DEFERRABLE INITIALLY DEFERRED;
ALTER TABLE app.embedding_jobs
    ADD CONSTRAINT embedding_jobs_job_key_fkey FOREIGN KEY (job_id) REFERENCES app.job_keys (job_id)
        DEFERRABLE INITIALLY DEFERRED;
