import pytest

from pipeline_assets.content.extract import (
    ExtractError,
    extract_text,
)


def make_pdf(pages: list[str]) -> bytes:
    """A minimal valid PDF, one Helvetica text line per page, built by hand."""
    objects: list[bytes] = []
    n = len(pages)
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode())
    font_id = 3 + 2 * n
    for i, text in enumerate(pages):
        content = f"BT /F1 24 Tf 72 720 Td ({text}) Tj ET".encode()
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
            f"/Resources << /Font << /F1 {font_id} 0 R >> >> >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")

    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for num, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % num + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


# --- text formats -----------------------------------------------------------


@pytest.mark.parametrize("name", ["a.txt", "a.md", "a.MARKDOWN", "a.rst", "a.csv", "a.json"])
def test_text_formats(name):
    assert extract_text(name, "héllo\r\nworld\rend  \n".encode()) == "héllo\nworld\nend"


def test_bom_stripped_and_lines_kept():
    raw = b"\xef\xbb\xbf  first  \n\n\n  indented\n"
    assert extract_text("x.txt", raw) == "first  \n\n\n  indented"


def test_empty_and_whitespace_only():
    assert extract_text("e.txt", b"") == ""
    assert extract_text("e.md", b" \n\t\r\n ") == ""
    assert extract_text("e.html", b"<html><body> <script>x()</script> </body></html>") == ""


def test_nul_in_txt_is_binary():
    with pytest.raises(ExtractError) as e:
        extract_text("a.txt", b"abc\x00def")
    assert e.value.error_class == "unsupported_binary"


def test_bad_encoding_vs_replace():
    raw = b"caf\xe9 latin-1"
    with pytest.raises(ExtractError) as e:
        extract_text("a.txt", raw)
    assert e.value.error_class == "bad_encoding"
    assert str(e.value).startswith("bad_encoding: ")
    assert e.value.message in str(e.value)
    assert extract_text("a.txt", raw, decode_errors="replace") == "caf\ufffd latin-1"
    with pytest.raises(ValueError):
        extract_text("a.txt", raw, decode_errors="ignore")
