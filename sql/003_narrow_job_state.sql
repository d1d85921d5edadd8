-- The job identity moves out of the frequently-updated state row.
--
-- No job transition can be a HOT update (status sits in the claim index's
-- predicate), so every UPDATE of app.embedding_jobs writes a new entry into
-- every index of the table. With the unique (chunk_checksum, model_id) index
-- on it, each claim and each completion rewrote that wide entry too. Now the
-- identity lives in app.job_keys, written once at enqueue and never updated,
-- and app.embedding_jobs carries only narrow indexes (its bigint key and the
-- partial claim/lease/failed indexes). Lookups by content go through job_keys.
-- No job may be enqueued between the copy below and the constraint drop.
LOCK TABLE app.embedding_jobs IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE app.job_keys (
    chunk_checksum bytea NOT NULL,
    model_id       text NOT NULL,
    job_id         bigint NOT NULL,
    PRIMARY KEY (chunk_checksum, model_id)
);
INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)
SELECT chunk_checksum, model_id, job_id FROM app.embedding_jobs;
ALTER TABLE app.embedding_jobs DROP CONSTRAINT embedding_jobs_chunk_checksum_model_id_key;
