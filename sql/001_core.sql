-- Core schema: sources, documents, chunks, the embedding job queue, vectors.
-- Identities are content-derived (sha256 as bytea); see pipeline_assets/identity.py.

CREATE EXTENSION IF NOT EXISTS vector;
CREATE SCHEMA IF NOT EXISTS app;

-- One row per embedding model ever configured. model_id carries every option
-- that changes the vector; a new dimension is a new model.
CREATE TABLE app.models (
    model_id         text PRIMARY KEY,
    provider         text NOT NULL,
    name             text NOT NULL,
    dimension        int,                -- NULL until configured or first response
    max_input_tokens int,
    active           boolean NOT NULL DEFAULT true,
    created_at       timestamptz NOT NULL DEFAULT now()
);

-- Sources that were ingested, so reconciliation can re-scan them.
CREATE TABLE app.sources (
    source_id    int GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind         text NOT NULL DEFAULT 'directory',
    root         text NOT NULL UNIQUE,
    created_at   timestamptz NOT NULL DEFAULT now(),
    last_scan_at timestamptz
);

-- One row per source item. status: current | quarantined (guard or extract
-- failure; no chunks) | deleted (tombstone; no chunks).
CREATE TABLE app.documents (
    doc_pk            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source_id         int NOT NULL REFERENCES app.sources,
    document_id       text NOT NULL,
    source_uri        text NOT NULL,
    source_checksum   bytea,
    size_bytes        bigint,
    status            text NOT NULL CHECK (status IN ('current', 'quarantined', 'deleted')),
    extractor_version text,
    chunker_version   text,
    text_checksum     bytea,             -- sha256 of the extracted text (a data version)
    chunk_count       int NOT NULL DEFAULT 0,
    error_class       text,
    error_message     text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    UNIQUE (source_id, document_id)
);
CREATE INDEX documents_document_id ON app.documents (document_id);

-- Chunks of the CURRENT version of current documents only: a changed document
-- has its old chunks replaced in the same transaction, a deleted one loses them.
-- "Wanted content" is therefore exactly: some chunk row carries the checksum.
CREATE TABLE app.chunks (
    doc_pk         bigint NOT NULL REFERENCES app.documents ON DELETE CASCADE,
    chunk_index    int NOT NULL,
    chunk_checksum bytea NOT NULL,
    text           text NOT NULL,
    token_count    int NOT NULL,
    char_start     int NOT NULL,
    char_end       int NOT NULL,
    PRIMARY KEY (doc_pk, chunk_index)
);
CREATE INDEX chunks_checksum ON app.chunks (chunk_checksum);

-- The job queue. Identity (chunk_checksum, model_id) is enforced here, not in
-- application code. Transitions update only the narrow state columns; the
-- fillfactor leaves room on each page for the new row versions.
CREATE TABLE app.embedding_jobs (
    job_id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    chunk_checksum   bytea NOT NULL,
    model_id         text NOT NULL REFERENCES app.models,
    status           text NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'processing', 'ready', 'retry', 'superseded', 'failed')),
    attempts         int NOT NULL DEFAULT 0,
    max_attempts     int NOT NULL DEFAULT 5,
    available_at     timestamptz NOT NULL DEFAULT now(),
    lease_owner      text,
    lease_expires_at timestamptz,
    error_class      text,
    error_message    text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (chunk_checksum, model_id)
) WITH (fillfactor = 70);
CREATE INDEX embedding_jobs_claimable ON app.embedding_jobs (model_id, available_at, job_id)
    WHERE status IN ('pending', 'retry');
CREATE INDEX embedding_jobs_leased ON app.embedding_jobs (lease_expires_at)
    WHERE status = 'processing';
CREATE INDEX embedding_jobs_failed ON app.embedding_jobs (updated_at)
    WHERE status = 'failed';

-- Vectors keyed by content + model. A row exists exactly while its job is
-- ready; superseding a job deletes its vector. Dimension-specific HNSW indexes
-- are created per model (partial expression indexes) by pipeline_assets/models.py.
CREATE TABLE app.embeddings (
    chunk_checksum bytea NOT NULL,
    model_id       text NOT NULL REFERENCES app.models,
    embedding      vector NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (chunk_checksum, model_id)
);

-- One row per item per stage: what ran, with which code, and how it ended.
CREATE TABLE app.stage_runs (
    doc_pk          bigint NOT NULL REFERENCES app.documents ON DELETE CASCADE,
    stage           text NOT NULL CHECK (stage IN ('extract', 'chunk', 'embed')),
    status          text NOT NULL CHECK (status IN ('running', 'succeeded', 'failed', 'pending', 'skipped')),
    attempts        int NOT NULL DEFAULT 1,
    error_class     text,
    last_error      text,
    code_version    text,
    config_hash     text,
    dagster_run_id  text,
    source_checksum bytea,
    started_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    PRIMARY KEY (doc_pk, stage)
);
CREATE INDEX stage_runs_rerun ON app.stage_runs (stage, status, error_class);

-- Provider state shared by every worker on every host: a throttle (429 /
-- Retry-After) pauses all claiming for the model until paused_until.
CREATE TABLE app.provider_state (
    model_id             text PRIMARY KEY REFERENCES app.models,
    paused_until         timestamptz NOT NULL DEFAULT '-infinity',
    consecutive_failures int NOT NULL DEFAULT 0,
    updated_at           timestamptz NOT NULL DEFAULT now()
);

-- Spend ledger: every billable provider call (including ones whose answer was
-- lost), and how many times each input was sent, so duplicate spend is measurable.
CREATE TABLE app.provider_calls (
    call_id    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    model_id   text NOT NULL,
    worker_id  text NOT NULL,
    inputs     int NOT NULL,
    tokens     int NOT NULL,
    outcome    text NOT NULL,          -- ok | error class
    http_status int,
    latency_ms int NOT NULL,
    called_at  timestamptz NOT NULL DEFAULT now()   -- when the call started
);
CREATE TABLE app.input_sends (
    chunk_checksum bytea NOT NULL,
    model_id       text NOT NULL,
    sends          int NOT NULL DEFAULT 1,
    PRIMARY KEY (chunk_checksum, model_id)
);
