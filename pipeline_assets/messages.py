"""A message squashed to one line, for one-line errors and log lines (no package imports: every layer may use it)."""

from __future__ import annotations


def one_line(message: object, *, first: bool = False) -> str:
    """``message`` (an exception or any text) with its white space runs folded to single spaces.

    With ``first``, only its first non-blank line (libpq's connection errors add a hint line). An
    exception with no text gives its type's name, so a log line never ends in nothing.
    """
    text = str(message).strip()
    if first and text:
        text = text.splitlines()[0]
    text = " ".join(text.split())
    if not text and isinstance(message, BaseException):
        return type(message).__name__
    return text
