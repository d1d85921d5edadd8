"""The vector index is built after an ingest, not during it.

A worker whose queue drains while an ingest is still running (between two of its batches)
does not build the model's HNSW index: an index built then would be maintained by every
later insert, over twice the cost of one build after them. The ingest is marked running
in app.running_ingests (a row with a beat), which works across processes and hosts; a
killed ingest's row stops counting once its beat expires.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid

import dagster as dg
import pytest
from psycopg import sql

from pipeline_assets.app import ingest, ingest_batches
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.defs.partitions import MODEL_PARTITIONS_NAME, bucket_key
from pipeline_assets.jobqueue import running_ingests
from pipeline_assets.jobqueue.worker import Worker
from pipeline_assets.registry import vector_index
from pipeline_assets.settings import Settings
from pipeline_assets.store import db
from pipeline_assets_tests.conftest import FAKE_DIM, FAKE_MODEL
from pipeline_assets_tests.dagster_helpers import (
    EMBED_JOB,
    embed_range_tags,
    execute,
    fresh_defs,
    materialization_metadata,
)
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli, wait_until

MODEL_ID = f"openai/{FAKE_MODEL}"
DOCS = 24
PAUSE_TIMEOUT_SECONDS = 120


@pytest.fixture(autouse=True)
def no_vector_index(conn):
    """clean_db keeps indexes: each test starts without the model's."""
    for (name,) in conn.execute(
        "SELECT indexname FROM pg_indexes WHERE schemaname = 'app' AND indexname LIKE 'embeddings_hnsw_%%'"
    ).fetchall():
        conn.execute(sql.SQL("DROP INDEX app.{}").format(sql.Identifier(name)))


def index_exists(conn) -> bool:
    return vector_index.exists(conn, MODEL_ID)


def ready(conn) -> int:
    return conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0]


def test_a_worker_beside_a_paused_ingest_builds_the_index_only_after_it(
    env, fake, clean_db, database_url, tmp_path, monkeypatch, caplog
):
    corpus = tmp_path / "c"
    write_corpus(corpus, DOCS)
    paused, resume = paused_ingest(monkeypatch)
    rt = Runtime.build(Settings.from_env())
    pool = db.make_pool(database_url)
    done: dict = {}
    ingesting = threading.Thread(target=lambda: done.setdefault("report", ingest.ingest_source(rt, pool, corpus)))
    stop = threading.Event()
    working = threading.Thread(
        target=lambda: done.setdefault(
            "work",
            Worker(
                database_url,
                rt.provider,
                rt.settings.worker_config(concurrency=2, poll_seconds=0.05, index_quiet_seconds=0.2),
                stop_event=stop,
            ).run(),
        )
    )
    caplog.set_level(logging.INFO, logger="pipeline_assets.jobqueue.worker")
    try:
        ingesting.start()
        wait_until(paused.is_set, timeout=60, what="the ingest's first batch")
        first = clean_db.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0]
        assert first > 0
        # A worker `--until-idle` drains the first batch and leaves without building.
        cli("work", "--until-idle", env=env)
        assert ready(clean_db) == first
        assert not index_exists(clean_db)
        with db.connect(database_url) as c:
            assert running_ingests.any_running(c)
        # A long-running worker drains, stays drained past its quiet period, and still waits.
        working.start()
        wait_until(
            lambda: index_exists(clean_db) or "drained while an ingest runs" in caplog.text,
            timeout=60,
            what="the long-running worker's drain",
        )
        assert not index_exists(clean_db)
        assert vector_index.state(clean_db, MODEL_ID, FAKE_DIM) == vector_index.MISSING
    finally:
        resume.set()
        ingesting.join(PAUSE_TIMEOUT_SECONDS)
    try:
        assert done["report"].scanned == DOCS
        with db.connect(database_url) as c:
            assert not running_ingests.any_running(c)  # the ingest's mark went with it
        chunks = clean_db.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
        wait_until(
            lambda: (
                ready(clean_db) == chunks and vector_index.state(clean_db, MODEL_ID, FAKE_DIM) == vector_index.READY
            ),
            timeout=60,
            what="every chunk ready and the index built",
        )
    finally:
        stop.set()
        if working.is_alive():
            working.join(30)
        pool.close()
    assert done["work"].embedded == chunks - first
    billed = fake.stats["billed_by_text"]  # every chunk sent and billed once
    assert sum(billed.values()) == len(billed) == chunks


def paused_ingest(monkeypatch):
    """The hook: after its first committed batch with chunks, the ingest waits for the test.
    Returns (paused, resume) events."""
    real_items = ingest_batches.ingest_items

    def in_small_batches(conn, source, source_id, items, options, report, **kwargs):
        """Several ingest transactions: two documents each."""
        small = dataclasses.replace(options, config=dataclasses.replace(options.config, batch_documents=2))
        return real_items(conn, source, source_id, items, small, report, **kwargs)

    monkeypatch.setattr(ingest, "ingest_items", in_small_batches)
    paused, resume = threading.Event(), threading.Event()
    real_write = ingest_batches.write

    def write_then_pause(*args, **kwargs):
        written = real_write(*args, **kwargs)
        if args[3] and not paused.is_set():
            paused.set()
            resume.wait(PAUSE_TIMEOUT_SECONDS)
        return written

    monkeypatch.setattr(ingest_batches, "write", write_then_pause)
    return paused, resume


def test_an_embeddings_run_beside_a_paused_ingest_leaves_the_index_to_the_next_run(
    env, fake, clean_db, database_url, tmp_path, monkeypatch
):
    """The Dagster path follows the workers' rule: an in-process embeddings run whose model's queue
    drains while an ingest runs does not build the index, says so in its metadata, and the next run
    that drains after the ingest builds it."""
    corpus = tmp_path / "c"
    write_corpus(corpus, DOCS)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(corpus))
    paused, resume = paused_ingest(monkeypatch)
    rt = Runtime.build(Settings.from_env())
    pool = db.make_pool(database_url)
    done: dict = {}
    ingesting = threading.Thread(target=lambda: done.setdefault("report", ingest.ingest_source(rt, pool, corpus)))
    defs, instance = fresh_defs(), dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(MODEL_PARTITIONS_NAME, [MODEL_ID])
    everything = embed_range_tags([bucket_key(i) for i in range(64)], [MODEL_ID])

    def embeddings_run() -> dict:
        """An embeddings run over every bucket, in-process; its run-level metadata."""
        result = execute(defs, instance, job=EMBED_JOB, tags=everything)
        assert result.success
        return materialization_metadata(result, "embeddings")

    try:
        ingesting.start()
        wait_until(paused.is_set, timeout=60, what="the ingest's first batch")
        first = clean_db.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0]
        assert first > 0
        meta = embeddings_run()  # embeds the first batch: the model's whole queue is idle at its end
        assert ready(clean_db) == first and meta["embedded"] == first
        assert not index_exists(clean_db)
        assert vector_index.state(clean_db, MODEL_ID, FAKE_DIM) == vector_index.MISSING
        assert "drained while an ingest runs" in meta["vector_index"]
        assert running_ingests.PUT_OFF_BUILDER in meta["vector_index"]
    finally:
        resume.set()
        ingesting.join(PAUSE_TIMEOUT_SECONDS)
    try:
        assert done["report"].scanned == DOCS
        with db.connect(database_url) as c:
            assert not running_ingests.any_running(c)
        chunks = clean_db.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
        assert chunks > first
        meta = embeddings_run()  # the next run embeds the rest, drains, and builds the index
        assert meta["embedded"] == chunks - first and "vector_index" not in meta
        assert ready(clean_db) == chunks
        assert vector_index.state(clean_db, MODEL_ID, FAKE_DIM) == vector_index.READY
    finally:
        pool.close()
    billed = fake.stats["billed_by_text"]  # every chunk sent and billed once
    assert sum(billed.values()) == len(billed) == chunks


def test_a_killed_ingest_stops_counting_once_its_beat_expires(clean_db):
    """A mark that is past alive_until (its ingest was killed and never beat again) counts for
    nothing; a live one counts whatever host wrote it."""
    assert not running_ingests.any_running(clean_db)
    params = {"ingest": uuid.uuid4(), "host": "elsewhere", "pid": 1, "alive_for": 60}
    clean_db.execute(running_ingests.INGESTS.begin, params)
    assert running_ingests.any_running(clean_db)
    clean_db.execute("UPDATE app.running_ingests SET alive_until = now() - interval '1 second'")
    assert not running_ingests.any_running(clean_db)
