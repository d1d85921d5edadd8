"""The source sensor and the rerun-after-fix sensor, evaluated as the daemon would, runs executed in-process."""

from __future__ import annotations

import dagster as dg
import pytest

from pipeline_assets.app import stages
from pipeline_assets.app.runtime import chunker_for
from pipeline_assets.settings import Settings
from pipeline_assets.defs.sensors import (MAX_KEYS_PER_TICK, contiguous_groups, decode_cursor,
                                             rerun_stale_documents_sensor, source_documents_sensor)
from pipeline_assets_tests.conftest import write_corpus
from pipeline_assets_tests.dagster_helpers import evaluate_sensor, execute, fresh_defs, requested_keys


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    write_corpus(root, 3)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    return root


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def _docs(conn) -> dict[str, str]:
    return dict(conn.execute("SELECT document_id, status FROM app.documents ORDER BY 1").fetchall())


def test_contiguous_groups():
    order = ["a", "b", "c", "d", "e"]
    assert contiguous_groups(order, {"a", "b", "d"}) == [["a", "b"], ["d"]]
    assert contiguous_groups(order, set(order)) == [order]
    assert contiguous_groups(order, set()) == []


def test_source_sensor_new_changed_deleted_and_duplicates(corpus, conn, fake, instance):
    defs = fresh_defs()
    # New: three documents -> three partitions added, ONE run over the range.
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    assert instance.get_dynamic_partitions("documents") == ["doc0000.md", "doc0001.md", "doc0002.md"]
    (request,) = tick.run_requests
    assert requested_keys(instance, request) == ["doc0000.md", "doc0001.md", "doc0002.md"]
    assert request.run_key.startswith("batch@g0:3:")
    assert execute(defs, instance, request).success
    assert _docs(conn) == {f"doc000{i}.md": "current" for i in range(3)}
    cursor = tick.cursor
    generation, seen = decode_cursor(cursor)
    assert generation == 1 and set(seen) == {"doc0000.md", "doc0001.md", "doc0002.md"}
    assert len(cursor) < 200   # compact: id -> 16 hex digits

    # Duplicate observation: nothing changed -> no run request; touching a file
    # (new mtime, same bytes) is no change either.
    (corpus / "doc0001.md").write_bytes((corpus / "doc0001.md").read_bytes())
    again = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    assert not again.run_requests and "no change" in again.skip_message
    # A replay of the same tick (cursor not saved) asks for the same run key: Dagster launches nothing new.
    replay = evaluate_sensor(source_documents_sensor, defs, instance, None)
    assert [r.run_key for r in replay.run_requests] == [request.run_key]

    # Changed: one document's bytes change -> one run for exactly that partition.
    billed = fake.stats["billed_inputs"]
    (corpus / "doc0001.md").write_text("# doc 1\n\nentirely new words here\n")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    (request,) = tick.run_requests
    checksum = decode_cursor(tick.cursor)[1]["doc0001.md"]
    assert request.partition_key == "doc0001.md"
    assert request.run_key == f"doc0001.md:{checksum}@g1"
    assert execute(defs, instance, request).success
    assert fake.stats["billed_inputs"] == billed + 1   # one new chunk; the other documents untouched
    cursor = tick.cursor

    # Scattered changes -> only the changed partitions, in contiguous groups.
    (corpus / "doc0000.md").write_text("changed zero\n")
    (corpus / "doc0002.md").write_text("changed two\n")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    assert sorted(requested_keys(instance, r)[0] for r in tick.run_requests) == ["doc0000.md", "doc0002.md"]
    assert all(r.partition_key for r in tick.run_requests)
    for r in tick.run_requests:
        assert execute(defs, instance, r).success
    cursor = tick.cursor

    # Deleted (and a new file with an id that cannot be a partition key, skipped).
    (corpus / "doc0002.md").unlink()
    (corpus / "bad|name.md").write_text("x")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, cursor)
    assert not tick.run_requests
    assert instance.get_dynamic_partitions("documents") == ["doc0000.md", "doc0001.md"]
    assert _docs(conn)["doc0002.md"] == "deleted"
    assert conn.execute("""SELECT count(*) FROM app.chunks c JOIN app.documents d USING (doc_pk)
                           WHERE d.document_id = 'doc0002.md'""").fetchone()[0] == 0
    assert "doc0002.md" not in decode_cursor(tick.cursor)[1]
    # ...and observing the deletion again does nothing.
    again = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert not again.run_requests and not again.dynamic_partitions_requests


def test_source_sensor_bounds_a_tick(corpus, instance, monkeypatch):
    import pipeline_assets.defs.sensors as sensors

    monkeypatch.setattr(sensors, "MAX_KEYS_PER_TICK", 2)
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    assert len(instance.get_dynamic_partitions("documents")) == 2
    assert sum(len(requested_keys(instance, r)) for r in tick.run_requests) == 2
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert instance.get_dynamic_partitions("documents") == ["doc0000.md", "doc0001.md", "doc0002.md"]
    assert [requested_keys(instance, r) for r in tick.run_requests] == [["doc0002.md"]]
    assert MAX_KEYS_PER_TICK == 1000


def test_empty_source_deletes_nothing(corpus, instance):
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    for p in corpus.iterdir():
        p.unlink()
    again = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert "refusing" in again.skip_message and not again.dynamic_partitions_requests


def test_parser_fix_reruns_exactly_the_stale_partitions(corpus, conn, fake, instance, monkeypatch):
    write_corpus(corpus, 5)   # doc0000..doc0004
    keys = [f"doc{i:04d}.md" for i in range(5)]
    defs = fresh_defs()
    instance.add_dynamic_partitions("documents", keys)
    assert execute(defs, instance, tags={"dagster/asset_partition_range_start": keys[0],
                                         "dagster/asset_partition_range_end": keys[-1]}).success
    assert evaluate_sensor(rerun_stale_documents_sensor, defs, instance).skip_message
    billed = fake.stats["billed_inputs"]
    by_text = dict(fake.stats["billed_by_text"])

    # The parser fix: a new extractor version. doc0001 happens to be re-ingested
    # under it right away (by its own run), so it is not stale.
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2")
    defs = fresh_defs()
    assert execute(defs, instance, partition_key="doc0001.md").success
    tick = evaluate_sensor(rerun_stale_documents_sensor, defs, instance)
    requested = sorted(k for r in tick.run_requests for k in requested_keys(instance, r))
    assert requested == ["doc0000.md", "doc0002.md", "doc0003.md", "doc0004.md"]
    assert len(tick.run_requests) == 2          # [doc0000] and the range doc0002..doc0004
    for r in tick.run_requests:
        assert "extract-2" in r.run_key and r.tags["pipeline/force"] == "true"
    # Evaluated again before the runs: the same run keys (Dagster dedupes them).
    again = evaluate_sensor(rerun_stale_documents_sensor, defs, instance)
    assert [r.run_key for r in again.run_requests] == [r.run_key for r in tick.run_requests]

    for r in tick.run_requests:
        assert execute(defs, instance, r).success
    chunk_version = chunker_for(Settings.from_env()).version
    assert stages.rerun_targets(conn, stage="extract", not_version="extract-2") == []
    assert stages.rerun_targets(conn, stage="chunk", not_version=chunk_version) == []
    assert conn.execute("SELECT count(*) FROM app.stage_runs WHERE stage IN ('extract', 'chunk')"
                        " AND code_version NOT IN ('extract-2', %s)", (chunk_version,)).fetchone()[0] == 0
    # Same text -> same chunks -> nothing re-embedded, nothing billed again.
    assert fake.stats["billed_inputs"] == billed
    assert fake.stats["billed_by_text"] == by_text
    assert "nothing stale" in evaluate_sensor(rerun_stale_documents_sensor, defs, instance).skip_message


def test_rerun_sensor_waits_for_its_runs_in_flight(corpus, instance, conn):
    defs = fresh_defs()
    instance.add_dynamic_partitions("documents", ["doc0000.md"])
    run = instance.create_run_for_job(defs.resolve_job_def("embed_documents"),
                                      tags={"pipeline/trigger": "rerun_stale_documents"})
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.NOT_STARTED
    assert "in flight" in evaluate_sensor(rerun_stale_documents_sensor, defs, instance).skip_message
