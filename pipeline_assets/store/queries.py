"""Named SQL queries, loaded by name from ``sql/queries/<family>.sql``.

Each table family keeps its SQL in one plain-SQL file, in blocks introduced by a
``-- name: <query_name>`` line; the comment lines right after it document the query and are not
sent (docs/decisions/0005-statements-sent-without-comments.md). Python refers to a query by name
and passes parameters by name; no SQL is assembled from strings (dynamic identifiers go through
``psycopg.sql`` at the call site). Files are read on first use and cached for the process::

    JOBS = queries.load("jobs")
    conn.execute(JOBS.claim, {...})
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

PACKAGE_DIR = Path(__file__).resolve().parents[1]

_NAME_LINE = re.compile(r"^--\s*name:\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:--)?\s*$", re.M)


def sql_dir() -> Path:
    """The SQL shipped with the code: ``pipeline_assets/sql`` in an installed
    wheel, the repository's top-level ``sql/`` in a checkout."""
    for candidate in (PACKAGE_DIR / "sql", PACKAGE_DIR.parent / "sql"):
        if (candidate / "queries").is_dir():
            return candidate
    raise FileNotFoundError(f"no sql/ directory next to {PACKAGE_DIR}")


def parse(text: str, *, source: str = "<sql>") -> dict[str, str]:
    """``{name: sql}`` from a file of ``-- name:`` blocks."""
    marks = list(_NAME_LINE.finditer(text))
    if not marks:
        raise ValueError(f"{source}: no '-- name:' blocks")
    out: dict[str, str] = {}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        body = _without_leading_comments(text[mark.end() : end])
        name = mark.group(1)
        if name in out:
            raise ValueError(f"{source}: query {name!r} defined twice")
        if not body:
            raise ValueError(f"{source}: query {name!r} is empty")
        out[name] = body
    return out


def _without_leading_comments(block: str) -> str:
    """The SQL of a block: its documenting comment lines (and blank lines) before
    the first line of SQL dropped; comments inside the statement are kept."""
    lines = block.strip().splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("--")):
        lines.pop(0)
    return "\n".join(lines).strip()


class NamedQueries:
    """The queries of one family; ``family.name`` is the SQL text of a query."""

    def __init__(self, family: str, directory: Path | None = None) -> None:
        self.family = family
        self._directory = directory

    @cached_property
    def _queries(self) -> dict[str, str]:
        path = (self._directory or sql_dir() / "queries") / f"{self.family}.sql"
        return parse(path.read_text(encoding="utf-8"), source=str(path))

    def __getattr__(self, name: str) -> str:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._queries[name]
        except KeyError:
            raise AttributeError(f"no query {name!r} in sql/queries/{self.family}.sql") from None

    def names(self) -> list[str]:
        return sorted(self._queries)


_loaded: dict[str, NamedQueries] = {}


def load(family: str) -> NamedQueries:
    if family not in _loaded:
        _loaded[family] = NamedQueries(family)
    return _loaded[family]


def one_row(conn: psycopg.Connection, query: str, params: Any = None) -> tuple[Any, ...]:
    """The row of a query that always returns exactly one (an aggregate, INSERT ... RETURNING, a lock call)."""
    row = conn.execute(query, params).fetchone()
    if row is None:
        raise LookupError("a query that always returns a row returned none")
    return row


def scalar(conn: psycopg.Connection, query: str, params: Any = None) -> Any:
    """The first column of the row a query always returns (a count, a flag, ``now()``)."""
    return one_row(conn, query, params)[0]
