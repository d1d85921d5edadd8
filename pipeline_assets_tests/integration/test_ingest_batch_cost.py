"""An ingest batch's writes cost what the batch holds, not what the tables already hold, and
write what the statements they replaced wrote (stage rows, jobs, revived and superseded content)."""

from __future__ import annotations

import pytest

from pipeline_assets.app.ingest import ingest_directory
from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.app.runtime import IngestOptions
from pipeline_assets.content.chunking import Chunker
from pipeline_assets.jobqueue import transitions
from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import models
from pipeline_assets_tests.data_helpers import write_corpus

SPEC = ModelSpec(
    provider="test", name="cost", dimension=4, max_input_tokens=8191, max_batch_inputs=10, max_batch_tokens=1000
)
# Jobs of earlier content already queued: enough pages that a scan of job_keys is never the cheap plan.
EARLIER_JOBS = 20_000


def _options(batch: int = 20) -> IngestOptions:
    return IngestOptions(chunker=Chunker(), config=IngestConfig(batch_documents=batch, extract_processes=1))


def _seq_scans(conn, table: str) -> int:
    """Sequential scans of ``table`` so far, this backend's own counted in (flushed first)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return conn.execute("SELECT seq_scan FROM pg_stat_user_tables WHERE relid = %s::regclass", (table,)).fetchone()[0]


@pytest.fixture
def queued(clean_db):
    """A registered model and a queue of earlier jobs, never analyzed (a first ingest's statistics)."""
    models.ensure_model(clean_db, SPEC)
    with clean_db.transaction():  # a job and its key commit together (deferred foreign keys)
        clean_db.execute(
            """INSERT INTO app.embedding_jobs (chunk_checksum, model_id, status)
               SELECT sha256(('earlier' || g)::bytea), %s, 'ready' FROM generate_series(1, %s) g""",
            (SPEC.model_id, EARLIER_JOBS),
        )
        clean_db.execute(
            "INSERT INTO app.job_keys (chunk_checksum, model_id, job_id) "
            "SELECT chunk_checksum, model_id, job_id FROM app.embedding_jobs"
        )
    return clean_db


def test_a_batch_enqueue_probes_job_keys_and_never_scans_it(queued, tmp_path):
    conn = queued
    before = _seq_scans(conn, "app.job_keys")
    report = ingest_directory(conn, write_corpus(tmp_path / "c", 60)[0].parent, _options())
    assert report.new == 60 and report.enqueued == report.chunks > 0, report
    assert conn.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0] == EARLIER_JOBS + report.chunks
    assert _seq_scans(conn, "app.job_keys") == before  # three batches: each probed the index per key


def test_enqueue_for_documents_probes_job_keys_and_never_scans_it(queued, tmp_path):
    """A rerun or a vector wait enqueues the missing jobs of some documents: one index probe per
    key, whatever the statistics, and a job per chunk whose key was missing."""
    conn = queued
    report = ingest_directory(conn, write_corpus(tmp_path / "c", 60)[0].parent, _options())
    pks = [r[0] for r in conn.execute("SELECT doc_pk FROM app.documents WHERE status = 'current'")]
    with conn.transaction():  # their jobs are gone (a job and its key go together)
        conn.execute("DELETE FROM app.embedding_jobs j USING app.chunks c WHERE j.chunk_checksum = c.chunk_checksum")
        conn.execute("DELETE FROM app.job_keys k USING app.chunks c WHERE k.chunk_checksum = c.chunk_checksum")
    before = _seq_scans(conn, "app.job_keys")
    assert transitions.enqueue_for_docs(conn, pks, max_attempts=5) == report.chunks > 0
    assert _seq_scans(conn, "app.job_keys") == before
    jobs = conn.execute(
        """SELECT count(*), count(*) FILTER (WHERE j.status = 'pending' AND j.model_id = %s)
           FROM app.chunks c JOIN app.job_keys k USING (chunk_checksum) JOIN app.embedding_jobs j USING (job_id)""",
        (SPEC.model_id,),
    ).fetchone()
    assert jobs == (report.chunks, report.chunks)
    assert transitions.enqueue_for_docs(conn, pks, max_attempts=5) == 0  # known keys: nothing more


def test_a_batch_writes_the_stage_rows_jobs_and_supersedes_what_it_replaced(queued, tmp_path):
    conn = queued
    corpus = write_corpus(tmp_path / "c", 30)[0].parent
    (corpus / "broken.md").write_bytes(b"\xff\xfe not UTF-8 \xfa")
    first = ingest_directory(conn, corpus, _options())
    assert first.new == 31 and first.quarantined == 1 and first.enqueued == first.chunks, first
    stages = dict(
        conn.execute("""SELECT s.stage || ':' || s.status, count(*) FROM app.stage_runs s
                        GROUP BY 1""").fetchall()
    )
    assert stages == {"extract:succeeded": 30, "chunk:succeeded": 30, "extract:failed": 1, "chunk:skipped": 1}
    failed = conn.execute("""SELECT s.error_class, s.last_error, s.code_version = d.extractor_version,
                                    s.source_checksum = d.source_checksum
                             FROM app.stage_runs s JOIN app.documents d USING (doc_pk)
                             WHERE s.status = 'failed'""").fetchone()
    assert failed[0] is not None and failed[1] and failed[2] and failed[3]
    chunker = conn.execute("SELECT DISTINCT code_version FROM app.stage_runs WHERE stage = 'chunk'").fetchall()
    assert chunker == [(Chunker().version,)]

    # One document changes (its old chunk goes, superseded), another reverts to content already seen.
    doc0 = sorted(corpus.glob("doc*.md"))[0]
    original = doc0.read_text()
    doc0.write_text("something else entirely\n")
    second = ingest_directory(conn, corpus, _options())
    assert (second.changed, second.superseded, second.enqueued) == (1, 1, 1), second
    assert conn.execute(
        "SELECT attempts FROM app.stage_runs WHERE stage = 'chunk' AND doc_pk = "
        "(SELECT doc_pk FROM app.documents WHERE document_id = %s)",
        (doc0.name,),
    ).fetchone() == (2,)
    doc0.write_text(original)
    third = ingest_directory(conn, corpus, _options())
    assert (third.changed, third.revived, third.enqueued, third.superseded) == (1, 1, 0, 1), third
    assert conn.execute(
        "SELECT j.status FROM app.embedding_jobs j JOIN app.chunks c USING (chunk_checksum) "
        "JOIN app.documents d USING (doc_pk) WHERE d.document_id = %s",
        (doc0.name,),
    ).fetchall() == [("pending",)]
    unchanged = ingest_directory(conn, corpus, _options())
    assert (unchanged.unchanged, unchanged.enqueued, unchanged.revived, unchanged.superseded) == (31, 0, 0, 0)
