"""Text extraction: raw bytes of a source item -> normalised text.

By the extension of ``document_id``: text formats (UTF-8, BOM stripped); .html/.htm (visible text,
BeautifulSoup); .pdf (pypdf, pages joined by a blank line); anything else is sniffed (a NUL in the
first 8 KiB or invalid UTF-8: ``unsupported_binary``). ``normalise`` then makes line ends ``\n``,
removes NULs, replaces lone surrogates by U+FFFD and strips the whole text; empty text is "" (not
an error). Versions are per format (``format_of``, ``EXTRACTOR_VERSIONS``): a fix of one format
makes only that format's documents stale.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

from pipeline_assets.app.ingest_config import DECODE_POLICIES

TEXT_EXTENSIONS = frozenset({".txt", ".md", ".markdown", ".rst", ".csv", ".json"})
HTML_EXTENSIONS = frozenset({".html", ".htm"})
PDF_EXTENSIONS = frozenset({".pdf"})

# Formats, each with its own extractor version. "text" also covers any other
# extension (read as UTF-8 after sniffing).
TEXT, HTML, PDF = "text", "html", "pdf"
FORMATS = (TEXT, HTML, PDF)
EXTENSION_FORMATS: dict[str, str] = {
    **{e: TEXT for e in TEXT_EXTENSIONS},
    **{e: HTML for e in HTML_EXTENSIONS},
    **{e: PDF for e in PDF_EXTENSIONS},
}

# The version of the code every format shares (dispatch, normalise()): the
# Dagster code version of `documents`. Bump it, and every entry below, on a
# change that alters every format's output (every partition becomes stale, in
# the UI too). Each format started from it ("extract-1" is the one version all
# formats shared before versions were per format: a database extracted then is
# not stale).
EXTRACTOR_VERSION = "extract-1"
# Each format's extractor version: bump ONE format's entry (to the next number,
# e.g. "extract-2") on a change that alters that format's output text; only
# documents of that format become stale: in `rerun --stale` and for the rerun
# sensor (the Dagster code version of `documents` stays: see the README).
EXTRACTOR_VERSIONS: dict[str, str] = {TEXT: EXTRACTOR_VERSION, HTML: EXTRACTOR_VERSION, PDF: EXTRACTOR_VERSION}
SNIFF_BYTES = 8 * 1024  # how much of an unknown file is checked for NUL bytes

# Error classes recorded for failed documents.
TOO_LARGE = "too_large"
UNSUPPORTED_BINARY = "unsupported_binary"
BAD_ENCODING = "bad_encoding"
PARSE_ERROR = "parse_error"

_DROP_TAGS = ("script", "style", "noscript", "template")
# Elements that end a line, and elements that end a paragraph (blank line).
_LINE_TAGS = frozenset("br dd dt li option tr".split())
_PARAGRAPH_TAGS = frozenset(
    "address article aside blockquote caption details dialog div dl fieldset figcaption "
    "figure footer form h1 h2 h3 h4 h5 h6 header hr main nav ol p pre section summary "
    "table title ul".split()
)
_CELL_TAGS = frozenset({"td", "th"})  # cells of a row are separated by a space
_WS_RUN = re.compile(r"\s+")
_BLANK_RUNS = re.compile(r"\n{3,}")
_SURROGATES = re.compile("[\ud800-\udfff]")


class ExtractError(Exception):
    """A document that cannot be turned into text; ``error_class`` is stable."""

    def __init__(self, error_class: str, message: str) -> None:
        super().__init__(f"{error_class}: {message}")
        self.error_class = error_class
        self.message = message


def extract_text(document_id: str, raw: bytes, *, decode_errors: str = "strict") -> str:
    if decode_errors not in DECODE_POLICIES:
        raise ValueError(f"decode_errors must be one of {DECODE_POLICIES}, got {decode_errors!r}")
    ext = PurePosixPath(document_id).suffix.lower()
    if ext in TEXT_EXTENSIONS:
        text = _decode_text(raw, decode_errors)
    elif ext in HTML_EXTENSIONS:
        text = _html_to_text(_decode_text(raw, decode_errors))
    elif ext in PDF_EXTENSIONS:
        text = _pdf_to_text(raw)
    else:
        text = _sniff_text(raw)
    return normalise(text)


def format_of(document_id: str) -> str:
    """The format (key of EXTRACTOR_VERSIONS) ``extract_text`` treats a document as, by its extension."""
    return EXTENSION_FORMATS.get(PurePosixPath(document_id).suffix.lower(), TEXT)


@dataclass(frozen=True)
class ExtractorVersions:
    """The extractor version of each format; ``of(document_id)`` is the one a document is extracted under."""

    by_format: tuple[tuple[str, str], ...]

    @classmethod
    def of_formats(cls, versions: Mapping[str, str]) -> ExtractorVersions:
        unknown = set(versions) - set(FORMATS)
        if unknown:
            raise ValueError(f"unknown extractor format(s) {sorted(unknown)}; formats: {', '.join(FORMATS)}")
        return cls(tuple((f, versions.get(f, EXTRACTOR_VERSIONS[f])) for f in FORMATS))

    def of(self, document_id: str) -> str:
        return dict(self.by_format)[format_of(document_id)]

    def by_extension(self) -> dict[str, str]:
        """Every known extension (lower case, with its dot) with its format's version."""
        versions = dict(self.by_format)
        return {ext: versions[fmt] for ext, fmt in sorted(EXTENSION_FORMATS.items())}

    @property
    def default(self) -> str:
        """The version of a document whose extension is not listed (read as text)."""
        return dict(self.by_format)[TEXT]

    def __str__(self) -> str:
        """One label: the version, when every format has the same; else ``html=…,pdf=…,text=…``."""
        values = {v for _, v in self.by_format}
        if len(values) == 1:
            return values.pop()
        return ",".join(f"{f}={v}" for f, v in sorted(self.by_format))


def normalise(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    if not text.isascii():  # an ASCII text has none (and is not scanned)
        text = _SURROGATES.sub("\ufffd", text)
    return text.strip()


def _decode_text(raw: bytes, decode_errors: str) -> str:
    if b"\x00" in raw:
        raise ExtractError(UNSUPPORTED_BINARY, "NUL byte in a text file")
    try:
        # utf-8-sig strips a leading BOM.
        return raw.decode("utf-8-sig", errors=decode_errors)
    except UnicodeDecodeError as e:
        raise ExtractError(
            BAD_ENCODING,
            f"invalid UTF-8 at byte {e.start} (set PIPELINE_DECODE_ERRORS=replace to accept)",
        ) from None


def _sniff_text(raw: bytes) -> str:
    if b"\x00" in raw[:SNIFF_BYTES]:
        raise ExtractError(UNSUPPORTED_BINARY, "NUL byte in the first 8 KiB; looks binary")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ExtractError(UNSUPPORTED_BINARY, "unknown extension and not valid UTF-8") from None


def _html_to_text(html: str) -> str:
    from bs4 import BeautifulSoup, CData, NavigableString, Tag

    try:
        soup = BeautifulSoup(html, "html.parser")
        for tag in soup.find_all(_DROP_TAGS):
            tag.extract()
    except Exception as e:  # html.parser is lenient; this is a last resort
        raise ExtractError(PARSE_ERROR, f"html: {type(e).__name__}: {e}") from e

    # Walk the tree once (iteratively: deep nesting must not hit the recursion
    # limit). Text outside <pre> has whitespace runs collapsed to one space
    # (HTML rendering rules); line/paragraph elements request 1/2 newlines,
    # merged with neighbouring requests so adjacent blocks do not pile up
    # blank lines. Comments, doctypes and processing instructions are skipped.
    out: list[str] = []
    pending = 0  # newlines requested since the last text
    stack: list = [(child, False) for child in reversed(soup.contents)]
    while stack:
        item = stack.pop()
        if isinstance(item, int):  # end of a line/paragraph element
            pending = max(pending, item)
            continue
        node, in_pre = item
        if isinstance(node, Tag):
            breaks = 2 if node.name in _PARAGRAPH_TAGS else 1 if node.name in _LINE_TAGS else 0
            if breaks:
                pending = max(pending, breaks)
                stack.append(breaks)
            elif node.name in _CELL_TAGS and out and not pending:
                out.append(" ")
            pre = in_pre or node.name == "pre"
            stack.extend((child, pre) for child in reversed(node.contents))
        elif type(node) in (NavigableString, CData):
            text = str(node) if in_pre else _WS_RUN.sub(" ", node)
            if not text.strip() and (pending or not out):
                continue  # whitespace between blocks
            if pending and out:
                out.append("\n" * pending)
            pending = 0
            out.append(text)

    # Strip each line (removes collapse artefacts; <pre> indentation is lost),
    # then collapse runs of blank lines to a single blank line.
    lines = [line.strip() for line in "".join(out).split("\n")]
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines))


def _pdf_to_text(raw: bytes) -> str:
    try:
        from pypdf import PdfReader

        reader = PdfReader(io.BytesIO(raw))
        if reader.is_encrypted and not reader.decrypt(""):
            raise ExtractError(PARSE_ERROR, "encrypted PDF (no empty user password)")
        pages = [page.extract_text() or "" for page in reader.pages]
    except ExtractError:
        raise
    except Exception as e:  # pypdf raises many types on malformed input
        raise ExtractError(PARSE_ERROR, f"pdf: {type(e).__name__}: {e}") from e
    return "\n\n".join(page.strip() for page in pages)
