"""Ingest in parallel: extraction children run at the same time (one per usable core by default),
and the batches' transactions are written in a thread of their own while extraction goes on."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from pipeline_assets.app import document_writes
from pipeline_assets.app.ingest import ingest_directory
from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.app.runtime import IngestOptions
from pipeline_assets.content import process
from pipeline_assets.content.chunking import Chunker
from pipeline_assets.content.sandbox import Sandbox, usable_cores
from pipeline_assets.store.documents import INGEST_WRITE_LOCK_KEY
from pipeline_assets_tests.poison_chunker import RendezvousChunker

# How long a test waits for a condition that a correct ingest reaches in well under a second.
WAIT_SECONDS = 60.0


def _corpus(tmp_path, n: int):
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(n):
        (corpus / f"doc{i:03d}.md").write_text(f"# doc {i}\n\n" + " ".join(f"w{(i * 7 + j) % 97}" for j in range(50)))
    return corpus


def test_two_children_answer_calls_at_the_same_time(tmp_path):
    """Each call waits until the other child has started one too: one child alone never answers."""
    meeting = tmp_path / "pids"
    meeting.mkdir()
    chunker = RendezvousChunker(str(meeting), peers=2)
    with Sandbox(chunker.chunk, timeout=WAIT_SECONDS, memory_limit=0, processes=2) as box:
        assert box.submit("a", "first document") and box.submit("b", "second document")
        outcomes = dict(box.take() for _ in range(2))
        pids = set(box.pids)
    assert [c[0].text for c in (outcomes["a"], outcomes["b"])] == ["first document", "second document"]
    assert {int(p.name) for p in meeting.iterdir()} == pids and len(pids) == 2


@pytest.mark.skipif(usable_cores() < 2, reason="one usable core: the default pool is one child")
def test_an_ingest_extracts_on_every_usable_core_by_default(clean_db, tmp_path):
    meeting = tmp_path / "pids"
    meeting.mkdir()
    chunker = RendezvousChunker(str(meeting), peers=2, wait_seconds=15.0)
    report = ingest_directory(clean_db, _corpus(tmp_path, 6), IngestOptions(chunker=chunker, config=IngestConfig()))
    assert report.new == 6 and report.quarantined == 0, report
    assert clean_db.execute("SELECT count(*) FROM app.documents WHERE status = 'current'").fetchone()[0] == 6
    assert len(list(meeting.iterdir())) >= 2  # two children chunked at the same time


def test_extraction_goes_on_while_a_batch_waits_to_be_written(clean_db, database_url, tmp_path, monkeypatch):
    """The first batch's transaction waits for the ingest lock (held here): the documents of the
    next batches are extracted meanwhile, and all are written once it is released."""
    batch, n = 10, 60
    taken = []
    real_take = process.Extractor.take

    def take(self):
        outcome = real_take(self)
        taken.append(outcome[1].item.document_id)
        return outcome

    monkeypatch.setattr(process.Extractor, "take", take)
    corpus = _corpus(tmp_path, n)
    result: dict = {}
    with psycopg.connect(database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (INGEST_WRITE_LOCK_KEY,))
        options = IngestOptions(chunker=Chunker(), config=IngestConfig(batch_documents=batch, extract_processes=1))
        ingest = threading.Thread(target=lambda: result.update(report=ingest_directory(clean_db, corpus, options)))
        ingest.start()
        try:
            deadline = time.monotonic() + WAIT_SECONDS
            while len(taken) <= 2 * batch and time.monotonic() < deadline and ingest.is_alive():
                time.sleep(0.02)
            extracted_while_locked = len(taken)
            with psycopg.connect(database_url) as probe:
                written_while_locked = probe.execute("SELECT count(*) FROM app.documents").fetchone()[0]
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (INGEST_WRITE_LOCK_KEY,))
        ingest.join(WAIT_SECONDS)
    assert not ingest.is_alive()
    assert written_while_locked == 0 and extracted_while_locked > 2 * batch, (
        written_while_locked,
        extracted_while_locked,
    )
    assert result["report"].new == n and result["report"].chunks == n, result["report"]
    assert clean_db.execute("SELECT count(*) FROM app.documents WHERE status = 'current'").fetchone()[0] == n


def test_a_source_without_documents_looks_nothing_up_and_a_second_ingest_finds_them(clean_db, tmp_path, monkeypatch):
    lookups = []
    real_known = document_writes.known_documents

    def known(conn, source_id, ids):
        lookups.append(len(ids))
        return real_known(conn, source_id, ids)

    monkeypatch.setattr(document_writes, "known_documents", known)
    corpus = _corpus(tmp_path, 25)
    options = IngestOptions(chunker=Chunker(), config=IngestConfig(batch_documents=10))
    first = ingest_directory(clean_db, corpus, options)
    assert first.new == 25 and lookups == [], (first, lookups)
    second = ingest_directory(clean_db, corpus, options)
    assert second.unchanged == 25 and second.new == 0 and sorted(lookups) == [5, 10, 10], (second, lookups)
    assert clean_db.execute("SELECT count(*) FROM app.chunks").fetchone()[0] == 25


class _Interrupt(BaseException):
    """What a run's cancellation raises in the ingesting thread (like KeyboardInterrupt)."""


def test_an_interrupted_ingest_does_not_wait_for_a_batch_stuck_on_a_lock(clean_db, database_url, tmp_path, monkeypatch):
    batch = 5
    real_take = process.Extractor.take
    taken = []

    def take(self):
        taken.append(1)
        if len(taken) > 2 * batch:  # the first batch's transaction waits for the lock held below
            raise _Interrupt
        return real_take(self)

    monkeypatch.setattr(process.Extractor, "take", take)
    corpus = _corpus(tmp_path, 40)
    outcome: dict = {}

    def run():
        try:
            ingest_directory(
                clean_db,
                corpus,
                IngestOptions(chunker=Chunker(), config=IngestConfig(batch_documents=batch, extract_processes=1)),
            )
        except _Interrupt as exc:
            outcome["interrupted"] = exc

    with psycopg.connect(database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (INGEST_WRITE_LOCK_KEY,))
        try:
            ingest = threading.Thread(target=run)
            ingest.start()
            ingest.join(WAIT_SECONDS)  # the lock is still held: only a cancelled statement lets it end
            ended_while_locked = not ingest.is_alive()
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (INGEST_WRITE_LOCK_KEY,))
            ingest.join(WAIT_SECONDS)
    assert ended_while_locked and "interrupted" in outcome
    assert clean_db.execute("SELECT count(*) FROM app.documents").fetchone()[0] == 0  # nothing half-written
    assert clean_db.execute("SELECT 1").fetchone() == (1,)  # the connection is usable again
