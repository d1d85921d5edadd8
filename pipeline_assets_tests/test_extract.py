import pytest

from pipeline_assets.content.extract import (
    EXTRACTOR_VERSION,
    ExtractError,
    decode_policy_from_env,
    extract_text,
    extractor_version,
    normalise,
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


def test_decode_policy_from_env(monkeypatch):
    monkeypatch.delenv("PIPELINE_DECODE_ERRORS", raising=False)
    assert decode_policy_from_env() == "strict"
    monkeypatch.setenv("PIPELINE_DECODE_ERRORS", "replace")
    assert decode_policy_from_env() == "replace"
    monkeypatch.setenv("PIPELINE_DECODE_ERRORS", "bogus")
    with pytest.raises(ValueError):
        decode_policy_from_env()


def test_extractor_version(monkeypatch):
    monkeypatch.delenv("PIPELINE_EXTRACTOR_VERSION", raising=False)
    assert extractor_version() == EXTRACTOR_VERSION == "extract-1"
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2-test")
    assert extractor_version() == "extract-2-test"


# --- sniffing ---------------------------------------------------------------


def test_unknown_extension_binary():
    with pytest.raises(ExtractError) as e:
        extract_text("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    assert e.value.error_class == "unsupported_binary"
    # No NUL, but not UTF-8 either.
    with pytest.raises(ExtractError) as e:
        extract_text("blob.bin", bytes(range(0x80, 0x100)))
    assert e.value.error_class == "unsupported_binary"
    # The replace policy does not turn binaries into text.
    with pytest.raises(ExtractError):
        extract_text("blob.bin", b"\xff\xfe", decode_errors="replace")


def test_unknown_extension_utf8_accepted():
    assert extract_text("server.log", "2024 ok ✓\r\n".encode()) == "2024 ok ✓"
    assert extract_text("Makefile", b"all:\n\techo hi\n") == "all:\n\techo hi"


# --- html -------------------------------------------------------------------


HTML = b"""<!DOCTYPE html>
<html><head><title>The Title</title>
<style>body { color: red }</style>
<script>var secret = "do not index";</script></head>
<body>
  <!-- a comment -->
  <h1>Heading</h1>
  <p>First   paragraph with <b>bold</b> and
     <a href="#">a link</a>.</p>
  <noscript>enable js</noscript><template><p>tmpl</p></template>
  <div>Block one</div><div>Block two</div>
  <ul><li>item 1</li><li>item 2</li></ul>


  <p>Caf&eacute; &amp; more</p>
</body></html>"""


def test_html_text():
    text = extract_text("page.html", HTML)
    assert "<" not in text and ">" not in text
    for gone in ("secret", "color", "enable js", "tmpl", "a comment", "DOCTYPE"):
        assert gone not in text
    lines = text.split("\n")
    assert lines[0] == "The Title"
    assert "First paragraph with bold and a link." in lines
    assert "Block one" in lines and "Block two" in lines
    assert "item 1" in lines and "item 2" in lines
    assert "Café & more" in lines
    assert "\n\n\n" not in text
    assert "item 1\nitem 2" in text  # list items: one per line
    assert "Heading\n\nFirst paragraph" in text  # paragraphs: blank line


def test_html_br_pre_table():
    raw = b"<p>a<br>b</p><pre>x  =  1\ny = 2</pre><table><tr><td>c1</td><td>c2</td></tr></table>"
    assert extract_text("t.html", raw) == "a\nb\n\nx  =  1\ny = 2\n\nc1 c2"


def test_htm_and_bad_encoding():
    assert extract_text("p.HTM", b"<p>hi</p>") == "hi"
    with pytest.raises(ExtractError) as e:
        extract_text("p.htm", b"<p>caf\xe9</p>")
    assert e.value.error_class == "bad_encoding"


def test_html_deeply_nested():
    raw = b"<div>" * 5000 + b"deep" + b"</div>" * 5000
    assert extract_text("deep.html", raw) == "deep"


# --- pdf --------------------------------------------------------------------


def test_pdf_text():
    raw = make_pdf(["Hello PDF world", "Second page"])
    assert extract_text("doc.pdf", raw) == "Hello PDF world\n\nSecond page"


def test_pdf_without_text():
    assert extract_text("blank.pdf", make_pdf([""])) == ""


def test_pdf_garbage_is_parse_error():
    with pytest.raises(ExtractError) as e:
        extract_text("broken.pdf", b"this is not a pdf at all")
    assert e.value.error_class == "parse_error"


def test_normalise():
    assert normalise("\r\n a\x00b \r\n\r\n") == "ab"
    assert normalise("x\ud800y") == "x\ufffdy"
