"""Least-privilege roles: an owner that migrates, a worker without DDL, a reader.

``grant_statements`` renders the statements of ``sql/queries/roles.sql`` for three role names;
``apply`` runs them as an administrator. Every statement is idempotent (applying again changes only
what is missing); passwords are never set here. On the schema ``app``:

* owner: CREATE on the database, owns ``app``: ``migrate``, ``models index``;
* worker: SELECT, INSERT, UPDATE, DELETE on tables, sequences and functions; no DDL in ``app``;
* reader: SELECT, read-only transactions (``status``, dashboards).

Grants on future tables are the owner's default privileges: a later migration's table is granted at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from pipeline_assets.store import queries

ROLES = queries.load("roles")

# The role names `pipeline-assets roles` uses unless told others.
DEFAULT_OWNER_ROLE = "pipeline_owner"
DEFAULT_WORKER_ROLE = "pipeline_worker"
DEFAULT_READER_ROLE = "pipeline_reader"


@dataclass(frozen=True)
class RoleNames:
    owner: str = DEFAULT_OWNER_ROLE
    worker: str = DEFAULT_WORKER_ROLE
    reader: str = DEFAULT_READER_ROLE

    def all(self) -> tuple[str, str, str]:
        return (self.owner, self.worker, self.reader)


def grant_statements(names: RoleNames, database: str) -> list[sql.Composed]:
    """The grants, default privileges and schema, in the order they must run (roles exist)."""
    owner, worker, reader = (sql.Identifier(n) for n in names.all())
    db = sql.Identifier(database)

    def fmt(template: str, **fields: sql.Identifier) -> sql.Composed:
        return sql.SQL(template).format(**fields)

    statements = [
        fmt(ROLES.grant_database_owner, database=db, owner=owner),
        fmt(ROLES.grant_database_user, database=db, role=worker),
        fmt(ROLES.grant_database_user, database=db, role=reader),
        sql.Composed([sql.SQL(ROLES.create_extension)]),
        fmt(ROLES.create_schema, owner=owner),
        fmt(ROLES.grant_schema_usage, role=worker),
        fmt(ROLES.grant_schema_usage, role=reader),
        fmt(ROLES.grant_worker_tables, worker=worker),
        fmt(ROLES.grant_worker_sequences, worker=worker),
        fmt(ROLES.grant_functions, role=worker),
        fmt(ROLES.grant_functions, role=reader),
        fmt(ROLES.grant_reader_tables, reader=reader),
        fmt(ROLES.default_worker_tables, owner=owner, worker=worker),
        fmt(ROLES.default_worker_sequences, owner=owner, worker=worker),
        fmt(ROLES.default_functions, owner=owner, role=worker),
        fmt(ROLES.default_functions, owner=owner, role=reader),
        fmt(ROLES.default_reader_tables, owner=owner, reader=reader),
        fmt(ROLES.reader_read_only, reader=reader),
    ]
    return statements


def create_statement(name: str) -> sql.Composed:
    return sql.SQL(ROLES.create_role).format(role=sql.Identifier(name))


def apply(conn: psycopg.Connection, names: RoleNames) -> list[str]:
    """Create the missing roles, then grant; return the roles created by this call.

    ``conn`` is an administrator's, on the pipeline's database (the grants are per database).
    """
    if len(set(names.all())) != 3:
        raise ValueError("the owner, worker and reader roles must be three different roles")
    created = []
    with conn.transaction():
        for name in names.all():
            if conn.execute(ROLES.role_exists, {"name": name}).fetchone() is None:
                conn.execute(create_statement(name))
                created.append(name)
        database = queries.scalar(conn, ROLES.current_database)
        for statement in grant_statements(names, database):
            conn.execute(statement)
    return created
