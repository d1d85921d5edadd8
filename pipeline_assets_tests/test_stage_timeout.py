"""The per-document wall-clock limit on extract + chunk."""

from __future__ import annotations

import time

from pipeline_assets.content import process
from pipeline_assets.content.chunking import Chunker
from pipeline_assets.app.ingest import ingest_directory
from pipeline_assets.app.runtime import IngestOptions


def test_a_stalling_parser_quarantines_only_its_document(clean_db, tmp_path, monkeypatch):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "fine.md").write_text("an ordinary document")
    (corpus / "stall.md").write_text("this one makes the parser hang")
    real = process.extract_text

    def extract(document_id, raw, **kw):
        if document_id == "stall.md":
            time.sleep(30)  # a parser stuck on a pathological input
        return real(document_id, raw, **kw)

    monkeypatch.setattr(process, "extract_text", extract)
    started = time.monotonic()
    report = ingest_directory(clean_db, corpus, IngestOptions(chunker=Chunker(), max_bytes=1 << 20,
                                                              stage_timeout=0.5))
    assert time.monotonic() - started < 10
    assert report.quarantined == 1 and report.errors == {"timeout": 1}
    rows = dict(clean_db.execute("SELECT document_id, status || ':' || coalesce(error_class, '')"
                                 " FROM app.documents").fetchall())
    assert rows == {"fine.md": "current:", "stall.md": "quarantined:timeout"}
    assert clean_db.execute("SELECT count(*) FROM app.chunks").fetchone()[0] == 1
