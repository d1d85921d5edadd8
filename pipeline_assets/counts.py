"""``Counts``: the one ``as_dict`` of the report dataclasses (what a run counted, printed as JSON)."""

from __future__ import annotations

from typing import Any


class Counts:
    """Base of a report dataclass: ``as_dict()`` is its fields by name, in declaration order,
    without private ones (``_lock``); values are the report's own (not copied)."""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}
