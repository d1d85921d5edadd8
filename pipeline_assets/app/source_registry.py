"""Sources opened from their string: ``examples/corpus`` (a folder), ``s3://bucket/prefix``,
``table:schema.name?id=..&text=..``.

The part before the first ``:`` names the kind (``OPENERS``); a string without one (or
``file:``) is a folder path. Each opener takes the string and the ``SourceConfig`` and returns a
``content.source.Source`` whose ``key`` is the canonical form of that string, so the key
stored in ``app.sources.root`` opens the same source again (reconciliation re-opens every
source it finds there). A kind of source plugs in with one implementation and one entry
here. An unknown kind or a malformed string is a SourceError (one line).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from pipeline_assets.app.source_config import SourceConfig
from pipeline_assets.content.folder_source import FolderSource
from pipeline_assets.content.source import Source, SourceError
from pipeline_assets.jobqueue.backoff import full_jitter

Opener = Callable[[str, SourceConfig], Source]

# A kind is two or more letters (so a Windows drive letter, C:, stays a path).
_KIND = re.compile(r"^([a-z][a-z0-9+.-]+):")


def _open_s3(spec: str, config: SourceConfig) -> Source:
    from pipeline_assets.content.s3_source import S3Source  # the client is imported only when used

    def pause(attempt: int) -> float:  # the provider's retry policy: full jitter, its base and cap
        return full_jitter(attempt, base=config.retry_base, cap=config.retry_cap)

    return S3Source.open(spec, endpoint=config.s3_endpoint, pause=pause)


# kind -> opener. One entry per kind of source.
OPENERS: dict[str, Opener] = {
    "s3": _open_s3,
}


def _open_table(spec: str, config: SourceConfig) -> Source:
    from pipeline_assets.app.table_source import TableSource  # the database side only when named

    return TableSource(spec, config)


OPENERS["table"] = _open_table


def kind_of(spec: str) -> str | None:
    """The kind a source string names, or None for a folder path."""
    match = _KIND.match(spec)
    kind = match.group(1) if match else None
    return None if kind == "file" else kind


def open_source(spec: str | Path, config: SourceConfig) -> Source:
    """The source ``spec`` names (see the module docstring)."""
    if isinstance(spec, Path):
        return FolderSource(spec)
    kind = kind_of(spec)
    if kind is None:
        return FolderSource(spec.removeprefix("file://") if spec.startswith("file://") else spec)
    opener = OPENERS.get(kind)
    if opener is None:
        raise SourceError(
            f"unknown kind of source {kind!r} in {spec!r}; known: a folder path, "
            + ", ".join(f"{k}:..." for k in sorted(OPENERS))
        )
    return opener(spec, config)


def is_folder(spec: str) -> bool:
    return kind_of(spec) is None
