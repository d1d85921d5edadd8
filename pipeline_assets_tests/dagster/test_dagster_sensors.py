"""The source sensor and the rerun-after-fix sensor on bucket partitions, evaluated as the daemon would,
runs executed in-process."""

from __future__ import annotations

import hashlib
import json
import os
import time

import dagster as dg
import pytest

from pipeline_assets.app import observations
from pipeline_assets.app.runtime import chunker_for
from pipeline_assets.content import folder_source
from pipeline_assets.defs.ingest.rerun_sensor import rerun_stale_documents_sensor
from pipeline_assets.defs.ingest.source_sensor import decode_cursor, source_documents_sensor
from pipeline_assets.settings import Settings
from pipeline_assets.store import stage_runs
from pipeline_assets_tests.conftest import FAKE_MODEL, TEST_BUCKETS
from pipeline_assets_tests.dagster_helpers import (
    bucket_keys,
    bucket_of,
    evaluate_sensor,
    execute,
    fresh_defs,
    requested_keys,
    served,
)
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli

ALL = bucket_keys(TEST_BUCKETS)
pytestmark = pytest.mark.usefixtures("in_process_buckets")

HOUR_NS = 3600 * 10**9
MODEL_ID = f"openai/{FAKE_MODEL}"


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    write_corpus(root, 3)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    clean_db.execute("TRUNCATE app.source_observations")  # the source sensor's memory
    return root


def _docs(conn) -> dict[str, str]:
    return dict(conn.execute("SELECT document_id, status FROM app.documents ORDER BY 1").fetchall())


def _observed(conn) -> dict[str, str | None]:
    """The source sensor's observations: {document_id: checksum (None: gone)}."""
    return dict(conn.execute("SELECT document_id, checksum FROM app.source_observations ORDER BY 1").fetchall())


def _text(conn, document_id: str) -> str:
    return conn.execute(
        "SELECT coalesce(string_agg(c.text, ''), '') FROM app.chunks c JOIN app.documents d "
        "USING (doc_pk) WHERE d.document_id = %s AND d.status = 'current'",
        (document_id,),
    ).fetchone()[0]


def _age(root, seconds: int = 3600) -> None:
    """Set every file's mtime in the past: out of the window where a same-size rewrite could hide."""
    past = time.time_ns() - seconds * 10**9
    for p in root.rglob("*"):
        if p.is_file():
            os.utime(p, ns=(past, past))


def _span(*docs: str) -> list[str]:
    """The bucket keys of the smallest range holding these documents' buckets."""
    keys = sorted(bucket_of(d) for d in docs)
    return ALL[ALL.index(keys[0]) : ALL.index(keys[-1]) + 1]


def test_source_sensor_new_changed_deleted_and_duplicates(corpus, conn, fake, instance):
    defs = fresh_defs()
    # New: three documents -> ONE run over the range of their buckets.
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    (request,) = tick.run_requests
    docs3 = ["doc0000.md", "doc0001.md", "doc0002.md"]
    assert requested_keys(instance, request) == ALL  # the first request: every bucket, empty ones too
    assert request.run_key.startswith("sync@g0:3:")
    # A replay of the same tick (cursor not saved) asks for the same run key: Dagster launches nothing new.
    replay = evaluate_sensor(source_documents_sensor, defs, instance, None)
    assert [r.run_key for r in replay.run_requests] == [request.run_key]
    assert execute(defs, instance, request).success
    assert _docs(conn) == {d: "current" for d in docs3}
    cursor = tick.cursor
    assert decode_cursor(cursor) == (1, {})  # the generation only...
    assert len(cursor) < 40
    observed = _observed(conn)  # ...the checksums are in PostgreSQL
    assert set(observed) == set(docs3) and all(observed.values())

    # Duplicate observation: nothing changed -> no run request; touching a file
    # (new mtime, same bytes) is no change either.
    (corpus / "doc0001.md").write_bytes((corpus / "doc0001.md").read_bytes())
    again = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    assert not again.run_requests and "no change" in again.skip_message
    # Once its run has synced the files, a replay asks for nothing (the work is done).
    assert not evaluate_sensor(source_documents_sensor, defs, instance, None).run_requests

    # Changed: one document's bytes change -> one run of exactly its bucket.
    billed = fake.stats["billed_inputs"]
    (corpus / "doc0001.md").write_text("# doc 1\n\nentirely new words here\n")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    (request,) = tick.run_requests
    assert _observed(conn)["doc0001.md"] != observed["doc0001.md"]
    assert request.partition_key == bucket_of("doc0001.md")
    assert request.run_key.startswith("sync@g1:1:")
    assert execute(defs, instance, request).success
    assert fake.stats["billed_inputs"] == billed + 1  # one new chunk; the other documents untouched
    cursor = tick.cursor

    # Scattered changes -> still one run, over the span of their buckets.
    (corpus / "doc0000.md").write_text("changed zero\n")
    (corpus / "doc0002.md").write_text("changed two\n")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    (request,) = tick.run_requests
    assert requested_keys(instance, request) == _span("doc0000.md", "doc0002.md")
    assert execute(defs, instance, request).success
    assert fake.stats["billed_inputs"] == billed + 3
    cursor = tick.cursor

    # Deleted: the tick tombstones nothing itself; the run over its bucket does.
    (corpus / "doc0002.md").unlink()
    tick = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    (request,) = tick.run_requests
    assert request.partition_key == bucket_of("doc0002.md") and request.run_key.startswith("sync@g3:1:")
    assert _docs(conn)["doc0002.md"] == "current"  # not inside the evaluation
    assert _observed(conn)["doc0002.md"] is None
    # Re-evaluated before its cursor was saved: the same run key.
    replay = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    assert [r.run_key for r in replay.run_requests] == [request.run_key]
    assert execute(defs, instance, request).success
    assert _docs(conn)["doc0002.md"] == "deleted"
    assert (
        conn.execute("""SELECT count(*) FROM app.chunks c JOIN app.documents d USING (doc_pk)
                           WHERE d.document_id = 'doc0002.md'""").fetchone()[0]
        == 0
    )
    assert "doc0002.md" not in _observed(conn)
    # ...and observing the deletion again does nothing.
    again = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert not again.run_requests


def test_empty_source_deletes_nothing(corpus, instance):
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    for p in corpus.iterdir():
        p.unlink()
    again = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert "refusing" in again.skip_message and not again.run_requests


def _count_reads(monkeypatch) -> list[str]:
    """Every file the source sensor reads to checksum it, by document id."""
    reads: list[str] = []
    real = folder_source.file_checksum

    def counting(item, max_bytes):
        reads.append(item.document_id)
        return real(item, max_bytes)

    monkeypatch.setattr(folder_source, "file_checksum", counting)
    return reads


def test_source_sensor_cursor_stays_small_with_many_documents(corpus, conn, instance):
    write_corpus(corpus, 1500, words=5)
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    (request,) = tick.run_requests  # 1,500 new documents: one run, every bucket
    assert requested_keys(instance, request) == ALL
    assert decode_cursor(tick.cursor) == (1, {}) and len(tick.cursor.encode()) < 40
    assert len(_observed(conn)) == 1500
    # The cursor it replaces: the whole map, id -> 16 hex digits (~45 kB here, ~4 MB at 100,000).
    old = json.dumps({"v": 1, "g": 1, "d": _observed(conn)}, separators=(",", ":"), sort_keys=True)
    assert len(old) > 1000 * len(tick.cursor)
    # Everything was requested in that one tick.
    again = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert not again.run_requests and decode_cursor(again.cursor) == (1, {})  # unchanged: nothing asked


def test_unchanged_tick_reads_no_file(corpus, conn, fake, instance, monkeypatch):
    write_corpus(corpus, 20, words=5)
    _age(corpus)
    reads = _count_reads(monkeypatch)
    tick = evaluate_sensor(source_documents_sensor, fresh_defs(), instance)
    # New files are not read by the sensor: the run that ingests them reads each once.
    assert reads == [] and len(tick.run_requests) == 1
    assert all(observations.is_unread(c) for c in _observed(conn).values())
    assert execute(fresh_defs(), instance, tick.run_requests[0]).success
    assert _docs(conn) == {f"doc{i:04d}.md": "current" for i in range(20)}
    # The run recorded the checksum of the bytes it ingested.
    assert _observed(conn) == {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()[: observations.CHECKSUM_HEX] for p in corpus.iterdir()
    }
    cursor = tick.cursor
    # A code reload (fresh definitions, a fresh module state): the observations are in
    # PostgreSQL, so an unchanged tick reads nothing.
    reads.clear()
    again = evaluate_sensor(source_documents_sensor, fresh_defs(), instance, cursor)
    assert reads == [] and "no change among 20 documents" in again.skip_message
    # Touched (new mtime, same bytes): read once, no run; then trusted again.
    os.utime(corpus / "doc0003.md", ns=(time.time_ns() - HOUR_NS // 2,) * 2)
    again = evaluate_sensor(source_documents_sensor, fresh_defs(), instance, cursor)
    assert reads == ["doc0003.md"] and not again.run_requests
    reads.clear()
    assert evaluate_sensor(source_documents_sensor, fresh_defs(), instance, cursor).skip_message
    assert reads == []
    # Changed: only that file is read; one run for it. Its mtime is set a minute ahead, so both
    # ticks below start inside its racy window (observations.RACY_NS) however slow the machine is.
    (corpus / "doc0007.md").write_text("new words\n")
    ahead = time.time_ns() + 60 * 10**9
    os.utime(corpus / "doc0007.md", ns=(ahead, ahead))
    tick = evaluate_sensor(source_documents_sensor, fresh_defs(), instance, cursor)
    assert reads == ["doc0007.md"] and [r.partition_key for r in tick.run_requests] == [bucket_of("doc0007.md")]
    # Written just now: its mtime granule may still hide a same-size rewrite, so the next
    # tick reads it once more (and nothing else); once settled it is trusted.
    reads.clear()
    assert evaluate_sensor(source_documents_sensor, fresh_defs(), instance, tick.cursor).skip_message
    assert reads == ["doc0007.md"]
    _age(corpus)
    reads.clear()
    evaluate_sensor(source_documents_sensor, fresh_defs(), instance, tick.cursor)
    reads.clear()
    evaluate_sensor(source_documents_sensor, fresh_defs(), instance, tick.cursor)
    assert reads == []


def test_revert_to_earlier_bytes_runs_again(corpus, conn, instance):
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    a = (corpus / "doc0000.md").read_bytes()
    (corpus / "doc0000.md").write_bytes(b"version B\n")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    (to_b,) = tick.run_requests
    (corpus / "doc0000.md").write_bytes(a)  # A -> B -> A
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    (to_a,) = tick.run_requests
    assert to_a.run_key.startswith("sync@g2:1:") and to_a.run_key != to_b.run_key
    assert to_a.partition_key == to_b.partition_key == bucket_of("doc0000.md")


def test_source_sensor_backpressure(corpus, conn, instance):
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    (request,) = tick.run_requests
    # The daemon launched the run; it is still queued.
    run = instance.create_run_for_job(defs.resolve_job_def("sync_documents"), tags=request.tags)
    cursor = tick.cursor
    (corpus / "doc0001.md").write_text("changed one\n")
    (corpus / "doc0003.md").write_text("a new one\n")
    held = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    assert not held.run_requests and "still queued or running" in held.skip_message
    assert held.cursor == cursor
    assert "doc0003.md" not in _observed(conn)  # not even scanned: the walk waits for the run too
    # The run ends: the next tick asks for everything that waited, in one run.
    instance.report_run_canceled(instance.get_run_by_id(run.run_id))
    tick = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    (request,) = tick.run_requests
    assert requested_keys(instance, request) == _span("doc0001.md", "doc0003.md")
    assert decode_cursor(tick.cursor) == (2, {})


def test_a_file_back_before_its_run_is_left_current(corpus, conn, fake, instance):
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    assert execute(defs, instance, tick.run_requests[0]).success
    body = (corpus / "doc0001.md").read_bytes()
    (corpus / "doc0001.md").unlink()
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    (request,) = tick.run_requests
    (corpus / "doc0001.md").write_bytes(body + b"more\n")  # back before the run
    assert execute(defs, instance, request).success
    assert _docs(conn)["doc0001.md"] == "current"
    assert (
        "more"
        in conn.execute(
            "SELECT string_agg(c.text, '') FROM app.chunks c JOIN app.documents d "
            "USING (doc_pk) WHERE d.document_id = 'doc0001.md'"
        ).fetchone()[0]
    )


def test_a_failed_run_is_requested_again(corpus, conn, instance, monkeypatch):
    from pipeline_assets.app import buckets

    monkeypatch.setenv("PIPELINE_SOURCE_RETRY_BASE", "37")  # the backoff is the configured one
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    assert execute(defs, instance, tick.run_requests[0]).success
    (corpus / "doc0002.md").unlink()
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    (request,) = tick.run_requests

    def broken(*args, **kwargs):
        raise RuntimeError("database went away")

    real = buckets.ingest_documents
    monkeypatch.setattr(buckets, "ingest_documents", broken)
    assert not execute(defs, instance, request).success
    assert _observed(conn)["doc0002.md"] is None  # still gone, still pending
    assert _docs(conn)["doc0002.md"] == "current"
    monkeypatch.setattr(buckets, "ingest_documents", real)
    held = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)  # backing off
    assert not held.run_requests and "1 file(s) of failed or cancelled runs requested again in" in held.skip_message
    attempts, due_in = _retry_state(conn, "doc0002.md")
    assert attempts == 1 and 20 < due_in <= 37, due_in
    _retries_due(conn)
    again = evaluate_sensor(source_documents_sensor, defs, instance, held.cursor)
    (retry,) = again.run_requests
    assert retry.partition_key == request.partition_key and retry.run_key != request.run_key
    assert execute(defs, instance, retry).success
    assert _docs(conn)["doc0002.md"] == "deleted" and "doc0002.md" not in _observed(conn)


def _retries_due(conn) -> None:
    """The backoff of every file waiting to be requested again has passed (as if time went by)."""
    conn.execute("UPDATE app.source_observations SET retry_at = now() - interval '1 second' WHERE retry_at IS NOT NULL")


def _retry_state(conn, document_id: str) -> tuple[int, float | None]:
    """(requests of its current bytes, seconds until it may be requested again)."""
    return conn.execute(
        "SELECT request_attempts, extract(epoch FROM retry_at - now())::float8 "
        "FROM app.source_observations WHERE document_id = %s",
        (document_id,),
    ).fetchone()


def test_a_changed_file_whose_run_failed_is_requested_again_and_stays_searchable(
    corpus, conn, fake, instance, monkeypatch, env
):
    """A changed file whose run failed (or was cancelled) before syncing it is requested again, after a
    backoff that grows per failed request; meanwhile its stored chunks and vectors stay served (the
    run-failure repair reads no source file), and at the end it is served with the new text's vectors."""
    from pipeline_assets.app import buckets

    defs = fresh_defs()
    repair = defs.resolve_sensor_def("reconcile_on_run_failure")
    watching = evaluate_sensor(repair, defs, instance)
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    assert execute(defs, instance, tick.run_requests[0]).success
    old_text, chunks, vectors = served(conn, "doc0001.md", MODEL_ID)
    assert chunks == vectors > 0

    (corpus / "doc0001.md").write_text("# doc 1\n\nthe edit that has to reach search\n")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    (request,) = tick.run_requests
    real = buckets.ingest_documents

    def broken(*args, **kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(buckets, "ingest_documents", broken)
    failed = execute(defs, instance, request)
    assert not failed.success
    monkeypatch.setattr(buckets, "ingest_documents", real)

    # The failure asks for a repair of the job table; it reads no file, so nothing is re-ingested.
    (fix,) = evaluate_sensor(repair, defs, instance, watching.cursor).run_requests
    assert fix.run_config == {"ops": {"reconciliation": {"config": {"rescan": False}}}}
    repaired = defs.resolve_job_def("reconcile_job").execute_in_process(
        instance=instance, run_config=fix.run_config, tags=fix.tags, raise_on_error=False
    )
    assert repaired.success
    assert served(conn, "doc0001.md", MODEL_ID) == (old_text, chunks, vectors)  # still found, on its old vectors

    # The next tick does not drop the edit: it waits out the backoff, then asks again.
    held = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert not held.run_requests and "1 file(s) of failed or cancelled runs requested again in" in held.skip_message
    attempts, wait = _retry_state(conn, "doc0001.md")
    assert attempts == 1 and 50 < wait <= 60
    assert not evaluate_sensor(source_documents_sensor, defs, instance, held.cursor).run_requests
    _retries_due(conn)
    tick = evaluate_sensor(source_documents_sensor, defs, instance, held.cursor)
    (retry,) = tick.run_requests
    assert retry.partition_key == bucket_of("doc0001.md") and retry.run_key != request.run_key

    # Failing again doubles the wait; a cancelled run counts as one that failed.
    monkeypatch.setattr(buckets, "ingest_documents", broken)
    assert not execute(defs, instance, retry).success
    monkeypatch.setattr(buckets, "ingest_documents", real)
    held = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert not held.run_requests
    attempts, wait = _retry_state(conn, "doc0001.md")
    assert attempts == 2 and 110 < wait <= 120
    _retries_due(conn)
    tick = evaluate_sensor(source_documents_sensor, defs, instance, held.cursor)
    (third,) = tick.run_requests
    run = instance.create_run_for_job(defs.resolve_job_def("embed_documents"), tags=third.tags)
    instance.report_run_canceled(instance.get_run_by_id(run.run_id))
    held = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert not held.run_requests
    attempts, wait = _retry_state(conn, "doc0001.md")
    assert attempts == 3 and 230 < wait <= 240
    assert served(conn, "doc0001.md", MODEL_ID) == (old_text, chunks, vectors)

    # The hourly (full) reconciliation re-ingests the file meanwhile: its new chunks have no vector
    # yet, so the bucket run that embeds them is due at once, not after the backoff.
    full = defs.resolve_job_def("reconcile_job").execute_in_process(instance=instance, raise_on_error=False)
    assert full.success
    text, chunks, vectors = served(conn, "doc0001.md", MODEL_ID)
    assert "the edit that has to reach search" in text and vectors < chunks
    tick = evaluate_sensor(source_documents_sensor, defs, instance, held.cursor)
    (last,) = tick.run_requests
    assert execute(defs, instance, last).success
    text, chunks, vectors = served(conn, "doc0001.md", MODEL_ID)
    assert "the edit that has to reach search" in text and chunks == vectors > 0
    assert "no change" in evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor).skip_message
    hits = json.loads(cli("search", "the edit that has to reach search", "--json", env=env).stdout)
    assert hits[0]["document_id"] == "doc0001.md" and hits[0]["distance"] is not None


def test_scan_failure_fails_the_tick(corpus, conn, instance, monkeypatch):
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(corpus.parent / "not-there"))
    with pytest.raises(Exception, match="not found; nothing is deleted"):
        evaluate_sensor(source_documents_sensor, fresh_defs(), instance, tick.cursor)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(corpus))
    real_scandir = os.scandir

    def unreadable(path="."):  # the tests run as root: chmod 000 would not stop the walk
        if str(path).startswith(str(corpus)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", unreadable)
    with pytest.raises(Exception, match=r"cannot scan .*Permission denied"):
        evaluate_sensor(source_documents_sensor, fresh_defs(), instance, tick.cursor)
    assert len(_observed(conn)) == 3 and all(_observed(conn).values())  # nothing marked gone


def test_legacy_map_cursor_is_adopted(corpus, conn, instance, monkeypatch):
    _age(corpus)
    from pipeline_assets.content.folder_source import file_checksum
    from pipeline_assets.content.sources import scan_directory

    docs = {i.document_id: file_checksum(i, 1 << 20) for i in scan_directory(corpus)}
    legacy = json.dumps({"v": 1, "g": 7, "d": docs}, separators=(",", ":"), sort_keys=True)
    tick = evaluate_sensor(source_documents_sensor, fresh_defs(), instance, legacy)
    assert "no change among 3" in tick.skip_message and not tick.run_requests
    assert tick.cursor == '{"v":2,"g":7}'  # the map is gone from the cursor
    (corpus / "doc0001.md").write_text("changed since\n")
    tick = evaluate_sensor(source_documents_sensor, fresh_defs(), instance, tick.cursor)
    assert [(r.partition_key, r.run_key.split(":")[0]) for r in tick.run_requests] == [
        (bucket_of("doc0001.md"), "sync@g7")
    ]
    assert decode_cursor(tick.cursor) == (8, {})


ALL_RANGE = {"dagster/asset_partition_range_start": ALL[0], "dagster/asset_partition_range_end": ALL[-1]}


def test_parser_fix_reruns_exactly_the_stale_documents(corpus, conn, fake, instance, monkeypatch):
    write_corpus(corpus, 5)  # doc0000..doc0004
    keys = [f"doc{i:04d}.md" for i in range(5)]
    defs = fresh_defs()
    assert execute(defs, instance, tags=ALL_RANGE).success
    assert evaluate_sensor(rerun_stale_documents_sensor, defs, instance).skip_message
    billed = fake.stats["billed_inputs"]
    by_text = dict(fake.stats["billed_by_text"])

    # The parser fix: a new extractor version. doc0001 happens to be re-ingested
    # under it right away (by its own bucket's run), so it is not stale.
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2")
    defs = fresh_defs()
    assert execute(defs, instance, partition_key=bucket_of("doc0001.md")).success
    tick = evaluate_sensor(rerun_stale_documents_sensor, defs, instance)
    (request,) = tick.run_requests  # one run, every bucket (none stays stale in the UI)
    assert requested_keys(instance, request) == ALL
    assert "extract-2" in request.run_key and ":4:" in request.run_key  # four stale documents
    # Evaluated again before the run: the same run key (Dagster dedupes it).
    again = evaluate_sensor(rerun_stale_documents_sensor, defs, instance)
    assert [r.run_key for r in again.run_requests] == [request.run_key]

    # A source change meanwhile is not the rerun's: it re-extracts the stale documents only
    # (doc0001 is not stale: its own run re-extracted it).
    (corpus / "doc0001.md").write_text("# doc 1\n\nedited after the fix\n")
    result = execute(defs, instance, request)
    assert result.success
    ingest = {k: v.value for k, v in result.asset_materializations_for_node("ingest")[0].metadata.items()}
    assert ingest["stale_documents"] == 4 and ingest["changed_documents"] == 0 and ingest["files_read"] == 0
    assert "edited" not in _text(conn, "doc0001.md")
    attempts = dict(
        conn.execute(
            "SELECT d.document_id, s.attempts FROM app.stage_runs s JOIN app.documents d"
            " USING (doc_pk) WHERE s.stage = 'extract'"
        ).fetchall()
    )
    assert attempts == {k: 2 for k in keys}  # each redone once: doc0001 by its own run, the rest here
    chunk_version = chunker_for(Settings.from_env()).version
    assert stage_runs.rerun_targets(conn, stage="extract", not_version="extract-2") == []
    assert stage_runs.rerun_targets(conn, stage="chunk", not_version=chunk_version) == []
    # Same text -> same chunks -> nothing re-embedded, nothing billed again.
    assert fake.stats["billed_inputs"] == billed
    assert fake.stats["billed_by_text"] == by_text
    assert "nothing stale" in evaluate_sensor(rerun_stale_documents_sensor, defs, instance, tick.cursor).skip_message
    # ...the source sensor's next run is.
    (sync,) = evaluate_sensor(source_documents_sensor, defs, instance).run_requests
    assert execute(defs, instance, sync).success and "edited" in _text(conn, "doc0001.md")


def test_rerun_sensor_waits_for_its_runs_in_flight(corpus, instance, conn):
    defs = fresh_defs()
    run = instance.create_run_for_job(
        defs.resolve_job_def("sync_documents"), tags={"pipeline/trigger": "rerun_stale_documents"}
    )
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.NOT_STARTED
    assert "in flight" in evaluate_sensor(rerun_stale_documents_sensor, defs, instance).skip_message


def test_a_clean_check_stands_until_a_version_changes_or_it_is_old(corpus, conn, fake, instance, monkeypatch):
    """The rerun sensor ticks every few seconds; after a check that found nothing stale it reads
    nothing under the same code versions until RERUN_RECHECK_SECONDS have passed."""
    from pipeline_assets.defs.ingest import rerun_sensor

    assert execute(fresh_defs(), instance, tags=ALL_RANGE).success
    defs = fresh_defs()
    clean = evaluate_sensor(rerun_stale_documents_sensor, defs, instance)
    assert "nothing stale" in clean.skip_message
    state = rerun_sensor.decode_rerun_cursor(clean.cursor)
    assert state is not None and state.clean_versions and abs(state.clean_at - time.time()) < 600
    # A stale row another writer left (a process still on older code) ...
    conn.execute(
        "UPDATE app.stage_runs SET code_version = 'extract-0' WHERE stage = 'extract' AND doc_pk = "
        "(SELECT doc_pk FROM app.documents WHERE document_id = 'doc0000.md')"
    )
    held = evaluate_sensor(rerun_stale_documents_sensor, defs, instance, clean.cursor)
    assert not held.run_requests and "checked" in held.skip_message  # ... is not read under a fresh check
    # ... until that check is older than RERUN_RECHECK_SECONDS:
    monkeypatch.setattr(rerun_sensor, "RERUN_RECHECK_SECONDS", 0)
    (late,) = evaluate_sensor(rerun_stale_documents_sensor, defs, instance, clean.cursor).run_requests
    assert ":1:" in late.run_key
    # A version bump is checked at the first tick, whatever the last check's age.
    monkeypatch.setattr(rerun_sensor, "RERUN_RECHECK_SECONDS", 300)
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2")
    (bump,) = evaluate_sensor(rerun_stale_documents_sensor, fresh_defs(), instance, clean.cursor).run_requests
    assert "extract-2" in bump.run_key and ":3:" in bump.run_key
    assert (
        rerun_sensor.decode_rerun_cursor(
            evaluate_sensor(rerun_stale_documents_sensor, fresh_defs(), instance, clean.cursor).cursor
        ).clean_versions
        is None
    )


def test_a_pdf_only_fix_reruns_only_pdf_documents(corpus, conn, fake, instance, monkeypatch):
    from pipeline_assets_tests.unit.test_extract import make_pdf

    for i in range(2):
        (corpus / f"paper{i}.pdf").write_bytes(make_pdf([f"Paper {i} on backoff", f"its second page {i}"]))
    keys = sorted(p.name for p in corpus.iterdir())  # doc0000..doc0002.md, paper0..1.pdf
    defs = fresh_defs()
    assert execute(defs, instance, tags=ALL_RANGE).success
    billed = fake.stats["billed_inputs"]
    attempts = dict(
        conn.execute(
            "SELECT d.document_id, s.attempts FROM app.stage_runs s JOIN app.documents d"
            " USING (doc_pk) WHERE s.stage = 'extract'"
        ).fetchall()
    )
    assert attempts == {k: 1 for k in keys}

    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "pdf=extract-2")
    defs = fresh_defs()
    tick = evaluate_sensor(rerun_stale_documents_sensor, defs, instance)
    (request,) = tick.run_requests
    assert ":2:" in request.run_key  # the two PDFs are what is stale
    assert execute(defs, instance, request).success
    rows = {
        r[0]: (r[1], r[2])
        for r in conn.execute(
            "SELECT d.document_id, s.code_version, s.attempts FROM app.stage_runs s"
            " JOIN app.documents d USING (doc_pk) WHERE s.stage = 'extract'"
        )
    }
    assert rows == {k: ("extract-2", 2) if k.endswith(".pdf") else ("extract-1", 1) for k in keys}
    assert fake.stats["billed_inputs"] == billed  # same PDF texts: nothing sent again
    assert "nothing stale" in evaluate_sensor(rerun_stale_documents_sensor, defs, instance, tick.cursor).skip_message


def _used_run_keys(instance) -> set[str]:
    return {r.tags.get("dagster/run_key") for r in instance.get_runs()} - {None}


def _run_as_daemon(defs, instance, request):
    """Execute a request as the daemon launches it: with its run key tag (what Dagster deduplicates on)."""
    tags = {**request.tags, "dagster/run_key": request.run_key}
    return execute(defs, instance, partition_key=request.partition_key, tags=tags)


def _clock_ahead(monkeypatch, seconds: float) -> None:
    """The rerun sensor's clock, ``seconds`` ahead of the real one (nothing else's)."""
    from pipeline_assets.defs.ingest import rerun_sensor

    ahead = time.time() + seconds - time.monotonic()
    monkeypatch.setattr(
        rerun_sensor, "time", type("Clock", (), {"time": staticmethod(lambda: time.monotonic() + ahead)})
    )


def test_a_failing_rerun_backs_off_and_a_new_version_is_not_held_back(
    corpus, conn, fake, instance, monkeypatch, tmp_path
):
    from pipeline_assets.defs.ingest import rerun_sensor

    assert execute(fresh_defs(), instance, tags=ALL_RANGE).success
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2")
    defs = fresh_defs()
    cursor = None
    for failures in (1, 2, 3):
        tick = evaluate_sensor(rerun_stale_documents_sensor, defs, instance, cursor)
        (request,) = tick.run_requests
        monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(tmp_path / "missing"))  # the rerun fails
        assert not _run_as_daemon(fresh_defs(), instance, request).success
        monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(corpus))
        cursor = tick.cursor
        wait = rerun_sensor.RERUN_RETRY_BASE_SECONDS * 2 ** (failures - 1)  # 60, 120, 240 s
        _clock_ahead(monkeypatch, wait - 5)  # not yet: no relaunch every tick
        held = evaluate_sensor(rerun_stale_documents_sensor, defs, instance, cursor)
        assert not held.run_requests and f"failed {failures} time(s) in a row" in held.skip_message
        _clock_ahead(monkeypatch, wait + 1)
    failures, wait = rerun_sensor.retry_wait(
        instance, "extract=extract-2 chunk=" + chunker_for(Settings.from_env()).version, time.time() + 10**6
    )
    assert failures == 3 and wait == 0
    # The cap: failures in a row past it wait RERUN_RETRY_CAP_SECONDS, no longer.
    monkeypatch.setattr(rerun_sensor, "RERUN_RETRY_BASE_SECONDS", rerun_sensor.RERUN_RETRY_CAP_SECONDS)
    assert (
        rerun_sensor.retry_wait(
            instance, "extract=extract-2 chunk=" + chunker_for(Settings.from_env()).version, time.time()
        )[1]
        <= rerun_sensor.RERUN_RETRY_CAP_SECONDS
    )
    # A new version (the fix) is requested at the next tick, whatever the failures under the old one.
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-3")
    _clock_ahead(monkeypatch, 0)
    (fixed,) = evaluate_sensor(rerun_stale_documents_sensor, fresh_defs(), instance, cursor).run_requests
    assert "extract-3" in fixed.run_key
    assert _run_as_daemon(fresh_defs(), instance, fixed).success
    assert {r[0] for r in conn.execute("SELECT code_version FROM app.stage_runs WHERE stage = 'extract'")} == {
        "extract-3"
    }


def test_a_failed_rerun_is_requested_again_also_after_a_cursor_reset(
    corpus, conn, fake, instance, monkeypatch, tmp_path
):
    from pipeline_assets.defs.ingest import rerun_sensor

    assert execute(fresh_defs(), instance, tags=ALL_RANGE).success
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2")
    defs = fresh_defs()
    first = evaluate_sensor(rerun_stale_documents_sensor, defs, instance)
    (request,) = first.run_requests
    # Re-evaluated from the same (empty) cursor: the same key, so Dagster would launch nothing twice.
    assert [r.run_key for r in evaluate_sensor(rerun_stale_documents_sensor, defs, instance).run_requests] == [
        request.run_key
    ]

    # The rerun fails before committing anything (its source directory is gone for the run).
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(tmp_path / "missing"))
    assert not _run_as_daemon(fresh_defs(), instance, request).success
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(corpus))
    assert {r[0] for r in conn.execute("SELECT code_version FROM app.stage_runs WHERE stage = 'extract'")} == {
        "extract-1"
    }
    used = _used_run_keys(instance)
    assert request.run_key in used

    # The next tick waits out the backoff, then asks again, under a key no run has used.
    held = evaluate_sensor(rerun_stale_documents_sensor, defs, instance, first.cursor)
    assert not held.run_requests and "failed 1 time(s) in a row" in held.skip_message
    _clock_ahead(monkeypatch, rerun_sensor.RERUN_RETRY_BASE_SECONDS + 1)
    second = evaluate_sensor(rerun_stale_documents_sensor, defs, instance, first.cursor)
    (again,) = second.run_requests
    assert requested_keys(instance, again) == ALL and again.run_key not in used

    # A cursor reset (the UI's "reset cursor"): a new epoch from the run history, no collision either.
    reset = evaluate_sensor(rerun_stale_documents_sensor, defs, instance, None)
    (after_reset,) = reset.run_requests
    assert requested_keys(instance, after_reset) == ALL and after_reset.run_key not in used
    assert _run_as_daemon(defs, instance, after_reset).success
    assert {r[0] for r in conn.execute("SELECT code_version FROM app.stage_runs WHERE stage = 'extract'")} == {
        "extract-2"
    }
    assert "nothing stale" in evaluate_sensor(rerun_stale_documents_sensor, defs, instance, reset.cursor).skip_message


def test_buckets_a_backfill_already_synced_are_not_requested_again(corpus, conn, fake, instance):
    """A run the sensor did not request (a backfill from the UI) syncs the files: the next tick asks nothing."""
    _age(corpus)
    defs = fresh_defs()
    assert execute(defs, instance, tags=ALL_RANGE).success
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    assert not tick.run_requests and "no change" in tick.skip_message
    (corpus / "doc0001.md").write_text("changed after the backfill\n")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    (request,) = tick.run_requests
    assert request.partition_key == bucket_of("doc0001.md") or requested_keys(instance, request) == ALL


def test_a_run_that_synced_a_file_but_failed_to_embed_it_has_it_requested_again(corpus, conn, fake, instance):
    """The sensor's run ingests the edit (the file is synced), then its embeddings fail: the
    document's new chunks have no vector. The next free tick hands the file to the same backoff
    as an unsynced one, and the run requested after it embeds them."""
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    assert execute(defs, instance, tick.run_requests[0]).success
    (corpus / "doc0001.md").write_text("# doc 1\n\ningested but never embedded by its run\n")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    (request,) = tick.run_requests
    assert request.job_name == "sync_and_embed"
    no_worker = {"resources": {"embedding_run": {"config": {"in_process": False, "deadline_seconds": 0.5}}}}
    failed = execute(defs, instance, request, run_config=no_worker)  # no worker comes before its deadline
    assert not failed.success
    assert failed.is_node_success("sync_pending") and failed.is_node_failed("embed_synced")
    text, chunks, vectors = served(conn, "doc0001.md", MODEL_ID)
    assert "never embedded" in text and vectors < chunks  # synced, not searchable
    assert conn.execute(
        "SELECT synced = checksum FROM app.source_observations WHERE document_id = 'doc0001.md'"
    ).fetchone()[0]

    held = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert not held.run_requests and "1 file(s) of failed or cancelled runs requested again in" in held.skip_message
    attempts, wait = _retry_state(conn, "doc0001.md")
    assert attempts == 1 and 50 < wait <= 60
    again = evaluate_sensor(source_documents_sensor, defs, instance, held.cursor)  # handled once, not again
    assert not again.run_requests and again.cursor == held.cursor
    _retries_due(conn)
    tick = evaluate_sensor(source_documents_sensor, defs, instance, held.cursor)
    (retry,) = tick.run_requests
    assert retry.partition_key == bucket_of("doc0001.md") and retry.run_key != request.run_key
    assert execute(defs, instance, retry).success
    text, chunks, vectors = served(conn, "doc0001.md", MODEL_ID)
    assert "never embedded" in text and chunks == vectors > 0
    assert "no change" in evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor).skip_message
