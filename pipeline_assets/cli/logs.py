"""Logging, configured once by the root group (`--log-format auto|json|text`).

``auto``: JSON lines when stderr is not a terminal (a service, a pipe, a log
collector), readable lines when it is. A record's job context (``job_id``,
``document_id``, ``attempt``, ``worker_id``, ``model_id``, ``error_class``,
``rescued``; set with ``extra=`` by ``jobqueue/job_log.py``) becomes JSON fields,
or ``key=value`` after a readable line. Messages and tracebacks are passed
through the same redaction as error lines (credentials, passwords in URLs);
no log line carries document text.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pipeline_assets.providers import sanitize
from pipeline_assets.settings import redact_text

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

FORMATS = ("auto", "json", "text")

# The ``extra=`` fields a line about jobs may carry, in the order they are written.
CONTEXT_FIELDS = ("job_id", "document_id", "attempt", "worker_id", "model_id", "error_class", "rescued")

# Longest message or traceback line kept (a log line is not a dump).
MAX_LINE_CHARS = 4000


def _clean(text: str) -> str:
    """Each line redacted: no key, no password; whitespace of each line flattened."""
    return "\n".join(redact_text(sanitize(line, MAX_LINE_CHARS)) for line in text.splitlines())


def _context(record: logging.LogRecord) -> dict:
    return {k: getattr(record, k) for k in CONTEXT_FIELDS if hasattr(record, k)}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, the job context, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": _clean(record.getMessage()),
        }
        out.update(_context(record))
        if record.exc_info:
            out["exc"] = _clean(self.formatException(record.exc_info))
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...`` for a person at a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = _clean(super().format(record))
        context = " ".join(f"{k}={v}" for k, v in _context(record).items() if v is not None)
        return f"{line} [{context}]" if context else line


class _CurrentStderr:
    """Whatever ``sys.stderr`` is at the time of writing: a progress bar that redirects
    stderr while it is drawn (rich) prints log lines above itself instead of through itself."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(fmt: str = "auto", verbose: bool = False, stream: SupportsWrite[str] | None = None) -> str:
    """Send every log record (warnings included) to stderr in ``fmt``; returns the format chosen."""
    stream = stream or _CurrentStderr()
    if fmt == "auto":
        fmt = "text" if getattr(stream, "isatty", lambda: False)() else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.captureWarnings(True)  # a library's warning is a log line too, not a stray stderr line
    return fmt
