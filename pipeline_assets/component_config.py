"""What every component's configuration shares: its one-line error for a value out of range.

Each component keeps a small frozen config with its defaults as named constants beside it
(``jobqueue.executor_config``, ``jobqueue.worker_config``, ``app.ingest_config``, ``app.source_config``,
``store.database_config``, ``defs.dagster_config``, ``providers.provider_config``);
``Settings`` reads the environment and builds them. Config modules import nothing else of the
package, so every layer (and ``settings``) may import them.
"""

from __future__ import annotations

# How much of an error message (a provider's, a document's) is kept in the database.
ERROR_MESSAGE_MAX_CHARS = 500


class InvalidConfig(ValueError):
    """A configuration value is out of range; the message is one line naming the field."""

    def __init__(self, name: str, problem: str, value: object) -> None:
        self.name, self.problem, self.value = name, problem, value
        super().__init__(f"{name} {problem}, got {value!r}")


def check(config: object, checks: list[tuple[bool, str, str]]) -> None:
    """Raise InvalidConfig for the first ``(ok, field, problem)`` of ``config`` that is not ok."""
    for ok, name, problem in checks:
        if not ok:
            raise InvalidConfig(name, problem, getattr(config, name))
