"""Text fit to print: no password of a connection string, in any of its forms."""

from __future__ import annotations

import re


def redact_text(text: str) -> str:
    """Text fit to print: no password in a connection string, in any of its forms."""
    tails: set[str] = set()

    def hide(match: re.Match) -> str:
        # A password containing "@": a parser that stops at its first "@" (libpq) takes the
        # rest for the host and may echo it ("failed to resolve host 'rest@db'").
        parts = match.group(2).split("@")
        tails.update("@".join(parts[i:]) for i in range(1, len(parts)))
        return match.group(1) + "***@"

    # scheme://user:pass@host: up to the last "@" of the URL, so all of such a password is hidden
    text = re.sub(r"(://[^:/@\s]*:)(\S*)@", hide, text)
    for tail in sorted(filter(None, tails), key=len, reverse=True):
        text = text.replace(tail + "@", "***@")
    text = re.sub(r"(?i)(password\s*=\s*)('[^']*'|[^\s&]+)", r"\1***", text)  # key=value / ?password=
    return text
