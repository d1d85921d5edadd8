-- Run once by the pgvector/pgvector image when its data volume is new
-- (docker-entrypoint-initdb.d): Dagster's run, event-log and schedule storage
-- gets its own database next to the pipeline's (POSTGRES_DB). On a managed
-- PostgreSQL, create it once yourself. The pipeline's own schema is created by
-- `pipeline-assets migrate` (the compose file's `migrate` service), not here.
CREATE DATABASE dagster;
