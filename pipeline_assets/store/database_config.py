"""The project database's configuration: its URL (or the embedded server's home) and how its server
treats a session.

Defaults are the named constants beside it; ``Settings.database_config()`` builds it from the
environment. A value out of range is an ``InvalidConfig`` naming the field, in one line. The URL is
a secret: never in its repr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline_assets.component_config import check

# Where the embedded PostgreSQL lives when no database URL is set.
DEFAULT_HOME = Path("./.pipeline")
# How the database URL's server treats a session: `transaction` is a pooler in transaction mode
# (PgBouncer before 1.21), which cannot keep a prepared statement from one transaction to the next.
POOL_MODES = ("session", "transaction")
DEFAULT_POOL_MODE = "session"


@dataclass(frozen=True)
class DatabaseConfig:
    url: str | None = field(default=None, repr=False)  # None: the embedded server under ``home``
    home: Path = DEFAULT_HOME
    pool_mode: str = DEFAULT_POOL_MODE

    def __post_init__(self) -> None:
        check(self, [(self.pool_mode in POOL_MODES, "pool_mode", f"must be one of {POOL_MODES}")])

    @property
    def prepare(self) -> bool:
        """Whether statements may be prepared server-side (not through a transaction pooler)."""
        return self.pool_mode != "transaction"
