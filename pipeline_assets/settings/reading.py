"""How a setting is declared and read: a dataclass field naming its environment variable, its
default and what it bounds (``setting``), parsed by its type from the environment, once (``read``);
a value that cannot be used is a ``SettingsError`` naming the variable, in one line."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")  # a setting's type: its default's

# Settings whose value is read in lower case (a keyword).
KEYWORD_SETTINGS = ("decode_errors", "database_pool_mode")


class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message names the variable."""


def setting(env: str, default: T, doc: str, *, secret: bool = False, shown_default: str | None = None) -> T:
    """A field read from ``env``: ``doc`` and ``shown_default`` are its line of docs/configuration.md;
    a ``secret`` stays out of the repr."""
    return dataclasses.field(
        default=default,
        repr=not secret,
        metadata={"env": env, "doc": doc, "secret": secret, "shown_default": shown_default},
    )


def read(cls: type, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The values of ``cls``'s fields set in ``environ`` (default: ``os.environ``), parsed; a blank
    variable is unset."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = environ.get(f.metadata["env"])
        if raw is not None and raw.strip() != "":
            values[f.name] = _parse(f, raw.strip())
    return values


def env_of(cls: type, name: str) -> str:
    """The variable a field of ``cls`` is read from (``name`` itself if no field has that name)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata["env"]
    return name


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    env = f.metadata["env"]
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("Path"):
            return Path(raw)
    except ValueError:
        expected = "an integer" if kind.startswith("int") else "a number"
        raise SettingsError(f"{env} must be {expected}, got {raw!r}") from None
    if f.name in KEYWORD_SETTINGS:
        return raw.lower()
    return raw
