"""Ingest at the edges a real source meets:
links and ids that leave the source root, file names that are not UTF-8, the caps
on text and chunks per document, batches sized by bytes, FIFOs, deadlocks, and the
database errors the command line reports in one line."""

from __future__ import annotations

import os
import threading
import time
import uuid

import psycopg
import pytest

from pipeline_assets.app import document_writes
from pipeline_assets.app.ingest import ingest_directory, ingest_paths
from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.app.reconcile import reconcile
from pipeline_assets.app.runtime import IngestOptions
from pipeline_assets.content.chunking import Chunker
from pipeline_assets.content.sources import document_id_problem
from pipeline_assets.store import db, documents
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli

SECRET = "the private key that lives outside the source"


def _options(force: bool = False, **config) -> IngestOptions:
    return IngestOptions(
        chunker=Chunker(max_tokens=32, overlap=4), config=IngestConfig(max_bytes=1 << 20, **config), force=force
    )


def _docs(conn) -> dict[str, str]:
    return dict(
        conn.execute("SELECT document_id, status || ':' || coalesce(error_class, '') FROM app.documents").fetchall()
    )


def _nothing_holds_the_secret(conn) -> None:
    assert conn.execute("SELECT count(*) FROM app.chunks WHERE text LIKE %s", (f"%{SECRET[:20]}%",)).fetchone()[0] == 0


@pytest.fixture
def outside(tmp_path):
    (tmp_path / "outside").mkdir()
    secret = tmp_path / "outside" / "id_rsa"
    secret.write_text(SECRET)
    return secret


# -- the source root --------------------------------------------------------------------------
def test_a_link_out_of_the_root_is_quarantined_and_never_read(clean_db, tmp_path, outside):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 2)
    (corpus / "key.md").symlink_to(outside)
    (corpus / "keys").symlink_to(outside.parent, target_is_directory=True)
    (corpus / "inside-link.md").symlink_to(corpus / "doc0000.md")
    report = ingest_directory(clean_db, corpus, _options())
    assert _docs(clean_db) == {
        "doc0000.md": "current:",
        "doc0001.md": "current:",
        "inside-link.md": "current:",
        "key.md": "quarantined:outside_root",
    }
    assert report.errors == {"outside_root": 1}
    _nothing_holds_the_secret(clean_db)
    stage = clean_db.execute(
        "SELECT s.status, s.error_class FROM app.stage_runs s JOIN app.documents d"
        " USING (doc_pk) WHERE d.document_id = 'key.md' AND s.stage = 'extract'"
    ).fetchone()
    assert stage == ("failed", "outside_root")
    again = ingest_directory(clean_db, corpus, _options())  # the same quarantine is not rewritten
    assert again.unchanged == 4 and again.quarantined == 0


def test_ids_that_leave_the_root_are_refused(clean_db, tmp_path, outside):
    """Partition keys from the Dagster UI and ids of a rerun go through ingest_paths."""
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 1)
    (corpus / "keys").symlink_to(outside.parent, target_is_directory=True)
    bad = ["../outside/id_rsa", str(outside), "doc0000.md/../../outside/id_rsa", ".hidden", "./doc0000.md"]
    report = ingest_paths(clean_db, corpus, [*bad, "doc0000.md", "keys/id_rsa"], _options())
    assert report.errors == {"invalid_document_id": len(bad), "outside_root": 1}
    # An id through a linked directory is resolved on the file, not only the name.
    assert _docs(clean_db) == {"doc0000.md": "current:", "keys/id_rsa": "quarantined:outside_root"}
    _nothing_holds_the_secret(clean_db)
    for key in bad:
        assert document_id_problem(key), key  # refresh_documents (Dagster run config) refuses them too
    assert document_id_problem("doc0000.md") is None and document_id_problem("caf%E9.md") is None


# -- names that are not UTF-8 ----------------------------------------------------------------
def _write_latin1_name(corpus, name: bytes, text: str) -> None:
    with open(os.path.join(os.fsencode(corpus), name), "wb") as f:
        f.write(text.encode())


def test_a_name_that_is_not_utf8_is_one_documents_business(clean_db, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 250)  # more than one batch after the odd name
    _write_latin1_name(corpus, b"caf\xe9.md", "a document whose name is Latin-1")
    report = ingest_directory(clean_db, corpus, _options())
    assert report.scanned == 251 and report.quarantined == 0
    docs = _docs(clean_db)
    assert len(docs) == 251 and docs["caf%E9.md"] == "current:"
    uri = clean_db.execute("SELECT source_uri FROM app.documents WHERE document_id = 'caf%E9.md'").fetchone()[0]
    assert uri.endswith("/caf%E9.md")
    # The escaped id leads back to the file (a Dagster partition, a rerun): not tombstoned.
    again = ingest_paths(clean_db, corpus, ["caf%E9.md"], _options(force=True))
    assert again.deleted == 0 and again.changed == 1 and _docs(clean_db)["caf%E9.md"] == "current:"
    # Deletions are still seen: the tombstone step runs.
    (corpus / "doc0003.md").unlink()
    assert ingest_directory(clean_db, corpus, _options()).deleted == 1
    assert _docs(clean_db)["doc0003.md"] == "deleted:"


def test_reconcile_goes_on_to_every_source(clean_db, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    write_corpus(first, 3)
    write_corpus(second, 3, prefix="other")
    ingest_directory(clean_db, first, _options())
    ingest_directory(clean_db, second, _options())
    _write_latin1_name(first, b"r\xe9sum\xe9.txt", "appeared later")
    (first / "doc0001.md").unlink()
    (second / "other0002.md").unlink()
    (second / "other0000.md").write_text("changed")
    report = reconcile(clean_db, _options())
    assert report.sources == 2 and not report.missing_sources
    assert (report.new, report.deleted, report.changed) == (1, 2, 1)
    docs = _docs(clean_db)
    assert docs["r%E9sum%E9.txt"] == "current:"
    assert docs["doc0001.md"] == "deleted:" and docs["other0002.md"] == "deleted:"


# -- caps, batches, FIFOs --------------------------------------------------------------------
def test_text_and_chunk_caps_quarantine_only_their_document(clean_db, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "small.md").write_text("a short note")
    (corpus / "long.md").write_text("word " * 2000)  # 10,000 characters
    (corpus / "many.md").write_text("x y " * 400)  # 1,600 characters, ~25 chunks of 32 tokens
    report = ingest_directory(clean_db, corpus, _options(max_text_chars=5_000, max_chunks=10))
    assert _docs(clean_db) == {
        "small.md": "current:",
        "long.md": "quarantined:text_too_large",
        "many.md": "quarantined:too_many_chunks",
    }
    assert report.errors == {"text_too_large": 1, "too_many_chunks": 1}
    counts = dict(
        clean_db.execute(
            "SELECT d.document_id, count(c.*) FROM app.documents d LEFT JOIN app.chunks c USING (doc_pk) GROUP BY 1"
        ).fetchall()
    )
    assert counts == {"small.md": 1, "long.md": 0, "many.md": 0}
    # Raised caps let them through on the next ingest (a quarantine is not sticky).
    ingest_directory(clean_db, corpus, _options(force=True))
    assert set(_docs(clean_db).values()) == {"current:"}


def test_batches_are_sized_by_bytes(clean_db, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"d{i:02d}.md").write_text(f"document {i} " + "lorem ipsum dolor " * 300)  # ~5.4 KB each
    held = []
    real = document_writes.write_documents

    def spy(conn, source_id, todo, **kw):
        held.append(sum(p.text_bytes for p in todo))
        return real(conn, source_id, todo, **kw)

    monkeypatch.setattr(document_writes, "write_documents", spy)
    limit = 16_000
    report = ingest_directory(clean_db, corpus, _options(batch_bytes=limit))
    assert report.new == 12 and len(_docs(clean_db)) == 12
    per_doc = max(held) / 3
    assert len(held) >= 4, held  # 12 documents of ~6 KB of chunk text in 16 KB batches
    assert all(h < limit + per_doc for h in held), held  # a batch closes once it reaches the limit


def test_a_fifo_in_the_source_never_blocks(clean_db, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 2)
    os.mkfifo(corpus / "pipe.md")
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            full=ingest_directory(clean_db, corpus, _options()),
            named=ingest_paths(clean_db, corpus, ["pipe.md", "doc0000.md"], _options(force=True)),
        ),
        daemon=True,
    )
    t.start()
    t.join(30)
    if t.is_alive():
        with open(corpus / "pipe.md", "wb"):
            pass  # unblock it, then fail
        pytest.fail("ingest blocked on a FIFO")
    assert result["full"].scanned == 2 and result["named"].scanned == 1
    assert set(_docs(clean_db)) == {"doc0000.md", "doc0001.md"}


# -- smaller: deadlocks -----------------------------------------------------------------------
def test_a_deadlocked_ingest_transaction_is_retried(clean_db, database_url, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 3)
    ingest_directory(clean_db, corpus, _options())
    (corpus / "doc0001.md").write_text("changed, so ingest must update its row")
    deadlocks_before = clean_db.execute(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()[0]
    other, watcher = db.connect(database_url), db.connect(database_url)
    # The server looks for the deadlock in the ingest's session (which waits first), and only
    # once both wait, whatever the machine's load: ingest is the one it aborts.
    clean_db.execute("SET deadlock_timeout = '5s'")
    other.execute("SET deadlock_timeout = '600s'")
    try:
        # Another session holds the row ingest will update ...
        other.execute("BEGIN")
        other.execute("SELECT 1 FROM app.documents WHERE document_id = 'doc0001.md' FOR UPDATE")
        outcome = {}

        def run():
            try:
                outcome["report"] = ingest_directory(clean_db, corpus, _options())
            except Exception as exc:
                outcome["error"] = exc

        ingest = threading.Thread(target=run)
        ingest.start()
        pid = clean_db.info.backend_pid
        deadline = time.monotonic() + 120  # generous: only bounds a failure
        while time.monotonic() < deadline:  # ... until ingest, holding the write lock, waits for it
            waiting = watcher.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            if waiting and waiting[0] == "Lock":
                break
            time.sleep(0.02)
        else:
            pytest.fail("ingest never waited for the locked row")
        # ... and then wants ingest's write lock: a deadlock the server breaks by aborting ingest.
        other.execute(documents.DOCS.write_lock, {"key": documents.INGEST_WRITE_LOCK_KEY})
        other.execute("COMMIT")
        ingest.join(60)
    finally:
        other.close()
        watcher.close()
        clean_db.execute("RESET deadlock_timeout")
    assert "error" not in outcome, outcome.get("error")
    assert outcome["report"].changed == 1
    deadlocks = clean_db.execute(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()[0]
    assert deadlocks > deadlocks_before  # the deadlock really happened
    text = clean_db.execute(
        "SELECT string_agg(c.text, '') FROM app.chunks c JOIN app.documents d USING (doc_pk)"
        " WHERE d.document_id = 'doc0001.md'"
    ).fetchone()[0]
    assert text == "changed, so ingest must update its row"


# -- smaller: expected database errors are one line in the CLI -------------------------------
def _one_line_error(proc) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    return lines[0]


def test_a_read_only_database_is_one_line_error(env, clean_db, database_url, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 2)
    read_only = psycopg.conninfo.make_conninfo(database_url, options="-c default_transaction_read_only=on")
    line = _one_line_error(cli("ingest", str(corpus), env={**env, "PIPELINE_DATABASE_URL": read_only}, check=False))
    assert "read-only" in line


def test_a_role_without_privileges_is_one_line_error(env, clean_db, database_url, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 2)
    role, password = f"reader_{uuid.uuid4().hex[:8]}", "s3@cr3t"
    clean_db.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    try:
        url = psycopg.conninfo.make_conninfo(database_url, user=role, password=password)
        for args in (("ingest", str(corpus)), ("status",)):
            proc = cli(*args, env={**env, "PIPELINE_DATABASE_URL": url}, check=False)
            line = _one_line_error(proc)
            assert "permission denied" in line, line
            assert "cr3t" not in proc.stderr + proc.stdout
    finally:
        clean_db.execute(f"DROP OWNED BY {role}")
        clean_db.execute(f"DROP ROLE {role}")
