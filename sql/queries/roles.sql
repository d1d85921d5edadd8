-- Least-privilege roles (store/roles.py): owner (DDL), worker (rows only), reader (reads only).
-- psycopg.sql templates ({owner}, {worker}, {reader}, {role}, {database} are Identifiers); every
-- statement can run again and change nothing.

-- name: role_exists
-- Whether a role exists.
SELECT 1 FROM pg_roles WHERE rolname = %(name)s

-- name: create_role
-- LOGIN without a password: the administrator sets it out of band (psql's \password), never here.
CREATE ROLE {role} LOGIN

-- name: current_database
-- The database the grants are made on.
SELECT current_database()

-- name: grant_database_owner
-- The owner creates the app schema's objects (CREATE) and, like the others, temporary tables.
GRANT CONNECT, CREATE, TEMPORARY ON DATABASE {database} TO {owner}

-- name: grant_database_user
-- ingest stages a walk in temporary tables; nothing else is created by a worker or a reader.
GRANT CONNECT, TEMPORARY ON DATABASE {database} TO {role}

-- name: create_extension
-- Needs a role allowed to create it (a superuser, rds_superuser, ...); the owner's migration then finds it.
CREATE EXTENSION IF NOT EXISTS vector

-- name: create_schema
-- The application's schema, owned by the owner role.
CREATE SCHEMA IF NOT EXISTS app AUTHORIZATION {owner}

-- name: grant_schema_usage
-- USAGE only: no CREATE in the schema for the worker or the reader.
GRANT USAGE ON SCHEMA app TO {role}

-- name: grant_worker_tables
-- The worker role reads and writes rows, never DDL.
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA app TO {worker}

-- name: grant_worker_sequences
-- The identity columns' sequences (an INSERT calls nextval).
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA app TO {worker}

-- name: grant_functions
-- The schema's functions and trigger functions (they run with the caller's rights).
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA app TO {role}

-- name: grant_reader_tables
-- The reader role reads.
GRANT SELECT ON ALL TABLES IN SCHEMA app TO {reader}

-- name: default_worker_tables
-- The same rights on what the owner's future migrations create.
ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA app
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {worker}

-- name: default_worker_sequences
-- Sequences created later are usable by the worker role too.
ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA app GRANT USAGE, SELECT ON SEQUENCES TO {worker}

-- name: default_functions
-- Functions created later are callable by the role.
ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA app GRANT EXECUTE ON FUNCTIONS TO {role}

-- name: default_reader_tables
-- Tables created later are readable by the reader role too.
ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA app GRANT SELECT ON TABLES TO {reader}

-- name: reader_read_only
-- Belt and braces: the reader's transactions are read-only even where a grant is too wide.
ALTER ROLE {reader} SET default_transaction_read_only = on
