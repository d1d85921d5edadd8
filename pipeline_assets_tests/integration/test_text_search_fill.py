"""The chunks' text-search vectors are computed after the ingest writes the chunks.

The chunk COPY writes them NULL; an ingest computes them at its end, `embed` leaves them to its
worker, which computes them from its first beat with work queued (beside the sending, not after
the last answer) and again when its queue drains. Until then full-text search reads such a chunk
from its text: it is found, and ranked, exactly as once its vector is computed. Migration 042
turns the generated column into a plain one on a database with data, keeping its values.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
import uuid

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import ingest
from pipeline_assets.app import search as search_uc
from pipeline_assets.app.embed import work
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.settings import Settings
from pipeline_assets.store import db, queries, text_search
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli, wait_until

DOCS = 12
QUERY = "w5 w12 document"


def pending(conn) -> int:
    return text_search.pending(conn)


def not_as_computed(conn) -> int:
    """Chunks whose stored vector is not the one the server computes from their text now."""
    return conn.execute(
        "SELECT count(*) FROM app.chunks WHERE text_search IS DISTINCT FROM to_tsvector('english'::regconfig, text)"
    ).fetchone()[0]


def ranking(conn, query: str = QUERY, k: int = 50) -> list[tuple[str, int, float]]:
    return [
        (h["document_id"], h["chunk_index"], round(h["text_rank"], 9)) for h in search_uc.text_search(conn, query, k)
    ]


def ingest_leaving_the_vectors(database_url: str, corpus, documents: int) -> None:
    """Ingest ``documents`` new documents as `embed` does: their text-search vectors left unfilled."""
    write_corpus(corpus, documents)
    rt = Runtime.build(Settings.from_env())
    later = dataclasses.replace(rt, options=dataclasses.replace(rt.options, text_search_later=True))
    pool = db.make_pool(database_url)
    try:
        ingest.ingest_source(later, pool, corpus)
    finally:
        pool.close()


def test_an_ingest_computes_the_vectors_at_its_end(env, fake, clean_db, tmp_path):
    corpus = tmp_path / "c"
    write_corpus(corpus, DOCS)
    cli("ingest", str(corpus), env=env)
    assert clean_db.execute("SELECT count(*) FROM app.chunks").fetchone()[0] >= DOCS
    assert pending(clean_db) == 0 and not_as_computed(clean_db) == 0


def test_chunks_left_unfilled_are_searched_from_their_text_until_a_drain_fills_them(
    env, fake, clean_db, database_url, tmp_path
):
    corpus = tmp_path / "c"
    write_corpus(corpus, DOCS)
    rt = Runtime.build(Settings.from_env())
    later = dataclasses.replace(rt, options=dataclasses.replace(rt.options, text_search_later=True))
    pool = db.make_pool(database_url)
    try:
        ingest.ingest_source(later, pool, corpus)
        chunks = clean_db.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
        assert pending(clean_db) == chunks
        unfilled = ranking(clean_db)
        assert len(unfilled) >= 2  # found from their text
        # The worker's drain (`work --until-idle`, as `embed` runs it) computes them beside the index.
        report = work(rt, pool, until_idle=True, poll_seconds=0.05)
        assert report.embedded == chunks
    finally:
        pool.close()
    assert pending(clean_db) == 0 and not_as_computed(clean_db) == 0
    assert ranking(clean_db) == unfilled  # the same hits, the same scores


def held_worker(fake, database_url: str) -> tuple[Runtime, ConnectionPool, threading.Thread, list]:
    """(a runtime whose ingests leave the vectors to the worker, a pool, a worker thread not yet
    started, its reports): the fake holds the answer of "HELDCHUNK" until released."""
    rt = Runtime.build(Settings.from_env())
    later = dataclasses.replace(rt, options=dataclasses.replace(rt.options, text_search_later=True))
    pool = db.make_pool(database_url)
    fake.hold("HELDCHUNK")
    reports: list = []
    runner = threading.Thread(target=lambda: reports.append(work(rt, pool, until_idle=True, poll_seconds=0.05)))
    return later, pool, runner, reports


def test_a_worker_fills_the_vectors_while_its_queue_still_holds_work(env, fake, clean_db, database_url, tmp_path):
    """The fill runs beside the sending: with an answer held (the queue not drained), every chunk
    gets its vector; the drain is left with the index build alone."""
    corpus = tmp_path / "c"
    write_corpus(corpus, DOCS)
    (corpus / "held.md").write_text("# held\n\nHELDCHUNK pruning apple trees\n")
    later, pool, runner, reports = held_worker(fake, database_url)
    try:
        ingest.ingest_source(later, pool, corpus)
        chunks = clean_db.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
        assert pending(clean_db) == chunks
        runner.start()
        wait_until(lambda: fake.held >= 1, timeout=60, what="the held request")
        wait_until(lambda: pending(clean_db) == 0, timeout=60, what="the fill while an answer is held")
        outstanding = clean_db.execute("SELECT count(*) FROM app.embedding_jobs WHERE status <> 'ready'").fetchone()[0]
        assert outstanding >= 1  # the queue had not drained
    finally:
        fake.release()
        runner.join(120)
        pool.close()
    assert reports and reports[0].embedded == chunks
    assert pending(clean_db) == 0 and not_as_computed(clean_db) == 0


def test_chunks_committed_after_the_first_fill_are_filled_at_the_drain(env, fake, clean_db, database_url, tmp_path):
    """The worker's first fill ended while the queue still held work; an ingest then leaves more
    chunks unfilled (another `embed`'s): the drain computes them before `--until-idle` exits."""
    first, second = tmp_path / "a", tmp_path / "b"
    write_corpus(first, 3)
    (first / "held.md").write_text("# held\n\nHELDCHUNK pruning apple trees\n")
    write_corpus(second, 3, prefix="later")
    later, pool, runner, reports = held_worker(fake, database_url)
    try:
        ingest.ingest_source(later, pool, first)
        runner.start()
        wait_until(lambda: fake.held >= 1 and pending(clean_db) == 0, timeout=60, what="the first fill")
        ingest.ingest_source(later, pool, second)
        assert pending(clean_db) > 0
    finally:
        fake.release()
        runner.join(120)
        pool.close()
    assert reports and not runner.is_alive()
    assert pending(clean_db) == 0 and not_as_computed(clean_db) == 0


def test_embed_leaves_every_chunk_with_its_vector(env, fake, clean_db, tmp_path):
    corpus = tmp_path / "c"
    write_corpus(corpus, DOCS)
    cli("embed", str(corpus), env=env)
    assert clean_db.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0] >= DOCS
    assert pending(clean_db) == 0 and not_as_computed(clean_db) == 0


def test_fill_skips_rows_another_transaction_holds(clean_db, database_url, env, fake, tmp_path):
    """A chunk an ingest is replacing (its row locked) is not waited for: the holder's work."""
    ingest_leaving_the_vectors(database_url, tmp_path / "c", 2)
    total = pending(clean_db)
    with db.connect(database_url) as holder, holder.transaction():
        held = holder.execute(
            "SELECT doc_pk, chunk_index FROM app.chunks ORDER BY doc_pk, chunk_index LIMIT 1 FOR UPDATE"
        ).fetchall()
        with db.connect(database_url) as filler:
            assert text_search.fill(filler) == total - len(held)
    assert pending(clean_db) == len(held)
    assert text_search.fill(clean_db) == len(held) and pending(clean_db) == 0


def test_migration_042_keeps_the_stored_vectors_of_an_existing_database(server_url, tmp_path):
    """A database with chunks, migrated by the previous release (every migration but 042), upgrades:
    its chunks keep their vectors; chunks written after it are searchable before and after the fill."""
    before = tmp_path / "sql"
    before.mkdir()
    for path in sorted(queries.sql_dir().glob("[0-9][0-9][0-9]_*.sql")):
        if not path.name.startswith("042_"):
            shutil.copy(path, before / path.name)
    name = "t_fill_upgrade_" + uuid.uuid4().hex[:8]
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        with db.connect(psycopg.conninfo.make_conninfo(server_url, dbname=name)) as conn:
            db.migrate(conn, before)
            source = conn.execute("INSERT INTO app.sources (root) VALUES ('/old') RETURNING source_id").fetchone()[0]

            def chunk(document_id: str, text: str) -> None:
                doc = conn.execute(
                    "INSERT INTO app.documents (source_id, document_id, source_uri, status)"
                    " VALUES (%s, %s, %s, 'current') RETURNING doc_pk",
                    (source, document_id, f"file:///{document_id}"),
                ).fetchone()[0]
                conn.execute(
                    "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count,"
                    " char_start, char_end) VALUES (%s, 0, %s, %s, 5, 0, %s)",
                    (doc, uuid.uuid4().bytes, text, len(text)),
                )

            chunk("old.md", "Pruning apple trees in winter")
            assert "042_chunk_text_search_filled_after.sql" in db.migrate(conn)
            assert pending(conn) == 0 and not_as_computed(conn) == 0  # kept, not recomputed to NULL
            chunk("new.md", "Apple blossom in spring; prune after the harvest")
            assert pending(conn) == 1
            query = "when do I prune an apple tree?"
            unfilled = ranking(conn, query)
            assert {h[0] for h in unfilled} == {"old.md", "new.md"}
            assert text_search.fill(conn) == 1
            assert pending(conn) == 0 and not_as_computed(conn) == 0
            assert ranking(conn, query) == unfilled
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_cancelled_background_fill_stops_inside_its_batch(clean_db, database_url, env, fake, tmp_path):
    """A worker told to stop cancels its fill's running batch (rolled back), not only the next one:
    its stop stays within the deployment's grace period whatever the batch waits on."""
    ingest_leaving_the_vectors(database_url, tmp_path / "c", 2)
    total = pending(clean_db)
    with db.connect(database_url) as holder, holder.transaction():
        holder.execute("LOCK TABLE app.chunks IN ACCESS EXCLUSIVE MODE")  # the batch waits behind it
        background = text_search.BackgroundFill(lambda: db.connect(database_url)).start()
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%text_search%'"
        for _ in range(200):  # bounded: until the fill's batch is seen waiting on the lock
            if holder.execute(waiting).fetchone()[0]:
                break
            time.sleep(0.05)
        background.cancel(timeout=10.0)
        assert background.done and background.filled == 0  # the thread ended, inside the held lock
    assert pending(clean_db) == total  # the batch rolled back
