-- The bookkeeping of pipeline_assets/store/migrations.py.

-- name: lock
-- One migrating process at a time (released at commit).
SELECT pg_advisory_xact_lock(%(key)s)

-- name: create_schema
-- The application's schema, before any migration.
CREATE SCHEMA IF NOT EXISTS app

-- name: create_ledger
-- The ledger of applied migrations.
CREATE TABLE IF NOT EXISTS app.schema_migrations (
    version    text PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now())

-- name: ledger_exists
-- Read-only probe: has any migration run here (is there a ledger to read)?
SELECT to_regclass('app.schema_migrations') IS NOT NULL

-- name: applied
-- The migrations applied so far.
SELECT version FROM app.schema_migrations

-- name: record
-- Record a migration as applied (in its own transaction).
INSERT INTO app.schema_migrations (version) VALUES (%(version)s)

-- name: database_exists
-- Server-level: is there a database of this name (for Dagster's own storage)?
SELECT 1 FROM pg_database WHERE datname = %(name)s

-- name: create_database
-- A psycopg.sql template: {name} is an Identifier.
CREATE DATABASE {name}
