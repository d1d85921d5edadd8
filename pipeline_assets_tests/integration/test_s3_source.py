"""The S3 source (content/s3_source.py) against a real S3-compatible server (moto's server
mode on 127.0.0.1): embed/ingest follow edits, deletes and renames; an unchanged object is
never downloaded (the server's request log); the size guard applies before a download; an
unreachable endpoint or refused credentials is one line and tombstones nothing; a transient
failure is retried; a listing that changes while it is read converges on the next scan."""

from __future__ import annotations

import dagster as dg
import psycopg
import pytest

from pipeline_assets.app import observations
from pipeline_assets.app.ingest import ingest_all
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.app.source_registry import open_source
from pipeline_assets.content.s3_source import S3Source
from pipeline_assets.content.source import SourceError
from pipeline_assets.defs.ingest.source_sensor import source_documents_sensor
from pipeline_assets.settings import Settings
from pipeline_assets_tests.dagster_helpers import evaluate_sensor, execute, fresh_defs
from pipeline_assets_tests.dagster_instances import postgres_instance
from pipeline_assets_tests.processes import cli
from pipeline_assets_tests.s3_server import S3Server, free_port

BUCKET = "corpus"
SOURCE = f"s3://{BUCKET}/docs"


@pytest.fixture
def s3(tmp_path):
    with S3Server(tmp_path / "moto.log") as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture
def s3_env(env, s3, clean_db, monkeypatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return {**env, **s3.env()}


def _put(s3: S3Server, key: str, text: str) -> None:
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=text.encode())


def _docs(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute("SELECT document_id, status FROM app.documents ORDER BY 1").fetchall())


def _text(n: int) -> str:
    return f"Document {n}. " + " ".join(f"word{n}x{i}" for i in range(40))


def test_embed_follows_edits_deletes_and_renames_and_never_downloads_unchanged(s3, s3_env, database_url):
    for n in range(4):
        _put(s3, f"docs/d{n}.md", _text(n))
    _put(s3, "other/outside.md", _text(9))  # not under the prefix
    out = cli("embed", SOURCE, env=s3_env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _docs(database_url) == {f"s3://{BUCKET}/docs/d{n}.md": "current" for n in range(4)}
    assert sorted(s3.downloads(BUCKET)) == [f"docs/d{n}.md" for n in range(4)]

    before = len(s3.downloads(BUCKET))
    again = cli("ingest", SOURCE, "--json", env=s3_env)
    assert again.returncode == 0, again.stdout
    assert '"unchanged": 4' in again.stdout
    assert len(s3.downloads(BUCKET)) == before  # the rerun read nothing

    _put(s3, "docs/d0.md", _text(100))  # edit
    s3.client().delete_object(Bucket=BUCKET, Key="docs/d1.md")  # delete
    s3.client().copy_object(Bucket=BUCKET, Key="docs/moved.md", CopySource=f"{BUCKET}/docs/d2.md")  # rename
    s3.client().delete_object(Bucket=BUCKET, Key="docs/d2.md")
    out = cli("embed", SOURCE, "--json", env=s3_env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _docs(database_url) == {
        f"s3://{BUCKET}/docs/d0.md": "current",
        f"s3://{BUCKET}/docs/d1.md": "deleted",
        f"s3://{BUCKET}/docs/d2.md": "deleted",
        f"s3://{BUCKET}/docs/d3.md": "current",
        f"s3://{BUCKET}/docs/moved.md": "current",
    }
    assert sorted(s3.downloads(BUCKET)[before:]) == ["docs/d0.md", "docs/moved.md"]  # d3 unchanged: not read
    with psycopg.connect(database_url) as conn:
        kind = conn.execute("SELECT kind, root FROM app.sources").fetchall()
    assert kind == [("s3", SOURCE)]
    status = cli("status", env=s3_env)
    assert f"source s3 {SOURCE}: current=3 quarantined=0 deleted=2" in status.stdout, status.stdout


def test_size_guard_applies_from_the_listing(s3, s3_env, database_url):
    _put(s3, "docs/small.md", _text(1))
    _put(s3, "docs/big.md", "x" * 5000)
    out = cli("ingest", SOURCE, "--json", env={**s3_env, "PIPELINE_MAX_INPUT_BYTES": "4096"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert _docs(database_url)[f"s3://{BUCKET}/docs/big.md"] == "quarantined"
    assert s3.downloads(BUCKET) == ["docs/small.md"]  # the big one: never downloaded


def test_unreachable_endpoint_is_one_line_and_tombstones_nothing(s3, s3_env, database_url):
    for n in range(3):
        _put(s3, f"docs/d{n}.md", _text(n))
    assert cli("ingest", SOURCE, env=s3_env).returncode == 0
    down = {**s3_env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    for command in (("ingest", SOURCE), ("reconcile",)):
        out = cli(*command, env=down, check=False)
        if command[0] == "ingest":
            assert out.returncode == 1
            lines = (out.stdout + out.stderr).strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and "no answer" in lines[0], out.stderr
        assert set(_docs(database_url).values()) == {"current"}, command


def test_refused_credentials_are_one_line_without_the_secret(tmp_path, env, clean_db, database_url):
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYSECRET"
    with S3Server(tmp_path / "auth.log", auth=True) as s3:
        bad = {**env, **s3.env(), "AWS_ACCESS_KEY_ID": "AKIAUNKNOWNKEY000000", "AWS_SECRET_ACCESS_KEY": secret}
        out = cli("embed", SOURCE, env=bad, check=False)
        proc = cli("ingest", SOURCE, env=bad, check=False, process=True)
    assert out.returncode == 1 and proc.returncode == 1
    for text in (out.stdout + out.stderr, proc.stdout + proc.stderr):
        assert secret not in text and "AKIAUNKNOWNKEY" not in text
        lines = text.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "403" in lines[0], text
    assert _docs(database_url) == {}


def test_a_transient_failure_is_retried_with_the_pause(tmp_path, monkeypatch):
    """The first listing attempt finds nothing listening; the pause before the second starts the
    server on that port: the listing succeeds, after exactly one pause."""
    port = free_port()
    server = S3Server(tmp_path / "late.log", port=port)
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    pauses: list[int] = []

    def pause(attempt: int) -> float:
        pauses.append(attempt)
        if attempt == 1:
            server.start()
            server.client().create_bucket(Bucket=BUCKET)
            server.client().put_object(Bucket=BUCKET, Key="docs/a.md", Body=b"hello")
        return 0.0

    try:
        source = S3Source.open(SOURCE, endpoint=f"http://127.0.0.1:{port}", pause=pause)
        assert [i.document_id for i in source.items()] == [f"s3://{BUCKET}/docs/a.md"]
    finally:
        server.stop()
    assert pauses == [1]


def test_the_opener_pauses_with_the_providers_full_jitter(s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    settings = Settings(aws_endpoint_url=f"http://127.0.0.1:{free_port()}", backoff_base=0.001, backoff_cap=0.004)
    source = open_source(SOURCE, settings.source_config())
    with pytest.raises(SourceError, match="failed 4 times: no answer"):
        list(source.items())


def test_a_listing_that_changes_while_read_converges(s3, s3_env, clean_db, database_url):
    for n in range(3):
        _put(s3, f"docs/d{n}.md", _text(n))
    rt = Runtime.build(Settings.from_env())
    source = open_source(SOURCE, rt.settings.source_config())
    listed = source.items

    def changing():  # after the listing's first item: one object deleted, one added
        for i, item in enumerate(listed()):
            yield item
            if i == 0:
                s3.client().delete_object(Bucket=BUCKET, Key="docs/d1.md")
                _put(s3, "docs/late.md", _text(7))

    source.items = changing  # type: ignore[method-assign]
    ingest_all(clean_db, source, rt.options)
    source.items = listed  # type: ignore[method-assign]
    ingest_all(clean_db, source, rt.options)
    assert _docs(database_url) == {
        f"s3://{BUCKET}/docs/d0.md": "current",
        f"s3://{BUCKET}/docs/d1.md": "deleted",
        f"s3://{BUCKET}/docs/d2.md": "current",
        f"s3://{BUCKET}/docs/late.md": "current",
    }


def test_sensor_scan_of_an_unchanged_bucket_reads_nothing(s3, s3_env, clean_db):
    for n in range(5):
        _put(s3, f"docs/d{n}.md", _text(n))
    source = open_source(SOURCE, Settings.from_env().source_config())
    first = observations.scan(clean_db, source, max_bytes=1 << 20)
    assert (first.present, first.written, first.hashed, first.unread) == (5, 5, 0, 0)
    second = observations.scan(clean_db, source, max_bytes=1 << 20)
    assert (second.present, second.written, second.gone) == (5, 0, 0)
    _put(s3, "docs/d0.md", _text(50))
    s3.client().delete_object(Bucket=BUCKET, Key="docs/d4.md")
    third = observations.scan(clean_db, source, max_bytes=1 << 20)
    assert (third.present, third.written, third.gone) == (4, 1, 1)
    assert s3.downloads(BUCKET) == []  # the sensor never downloads an object


def test_the_dagster_sensor_follows_an_s3_prefix(s3, s3_env, clean_db, monkeypatch, server_url, database_url):
    """PIPELINE_SOURCE=s3://...: the sensor requests a run of what is new, changed or gone, downloads
    nothing itself; the run downloads only what changed; the documents asset names the source; an
    endpoint that is down fails the tick and deletes nothing."""
    monkeypatch.setenv("PIPELINE_SOURCE", SOURCE)
    for n in range(3):
        _put(s3, f"docs/d{n}.md", _text(n))
    with postgres_instance(server_url) as instance:
        defs = fresh_defs()
        tick = evaluate_sensor(source_documents_sensor, defs, instance)
        (request,) = tick.run_requests
        assert s3.downloads(BUCKET) == []  # the sensor lists; it never downloads
        assert execute(defs, instance, request).success
        assert _docs(database_url) == {f"s3://{BUCKET}/docs/d{n}.md": "current" for n in range(3)}
        assert sorted(s3.downloads(BUCKET)) == [f"docs/d{n}.md" for n in range(3)]
        event = instance.get_latest_materialization_event(dg.AssetKey("documents"))
        assert event is not None and event.asset_materialization is not None
        assert event.asset_materialization.metadata["source_kind"].value == "s3"

        again = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
        assert not again.run_requests and "no change" in again.skip_message

        _put(s3, "docs/d0.md", _text(50))
        s3.client().delete_object(Bucket=BUCKET, Key="docs/d2.md")
        before = len(s3.downloads(BUCKET))
        changed = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
        for run in changed.run_requests:
            assert execute(defs, instance, run).success
        assert _docs(database_url) == {
            f"s3://{BUCKET}/docs/d0.md": "current",
            f"s3://{BUCKET}/docs/d1.md": "current",
            f"s3://{BUCKET}/docs/d2.md": "deleted",
        }
        assert s3.downloads(BUCKET)[before:] == ["docs/d0.md"]

        # refresh_documents by s3 id: only that object read.
        _put(s3, "docs/d1.md", "refreshed words for one object")
        refresh = defs.resolve_job_def("refresh_documents").execute_in_process(
            instance=instance,
            run_config={"ops": {"refresh_documents_op": {"config": {"document_ids": [f"s3://{BUCKET}/docs/d1.md"]}}}},
        )
        assert refresh.success
        assert s3.downloads(BUCKET)[before + 1 :] == ["docs/d1.md"]
        with psycopg.connect(database_url) as conn:
            text = conn.execute(
                "SELECT string_agg(c.text, '') FROM app.chunks c JOIN app.documents d USING (doc_pk) "
                "WHERE d.document_id = %s",
                (f"s3://{BUCKET}/docs/d1.md",),
            ).fetchone()[0]
        assert "refreshed words" in text

        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        with pytest.raises(Exception, match="nothing is deleted"):
            evaluate_sensor(source_documents_sensor, fresh_defs(), instance, changed.cursor)
    assert _docs(database_url)[f"s3://{BUCKET}/docs/d1.md"] == "current"


def test_same_bytes_under_a_new_etag_are_read_once(s3, s3_env, database_url):
    """An object rewritten with the same bytes but another ETag (a multipart upload) is read once,
    re-recorded under its new token, and not read again by the next ingest."""
    _put(s3, "docs/a.md", _text(1))
    assert cli("ingest", SOURCE, env=s3_env).returncode == 0
    client = s3.client()
    upload = client.create_multipart_upload(Bucket=BUCKET, Key="docs/a.md")
    part = client.upload_part(
        Bucket=BUCKET, Key="docs/a.md", UploadId=upload["UploadId"], PartNumber=1, Body=_text(1).encode()
    )
    client.complete_multipart_upload(
        Bucket=BUCKET,
        Key="docs/a.md",
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]},
    )
    before = len(s3.downloads(BUCKET))
    assert cli("ingest", SOURCE, env=s3_env).returncode == 0
    assert len(s3.downloads(BUCKET)) == before + 1  # the new ETag: read once
    assert cli("ingest", SOURCE, env=s3_env).returncode == 0
    assert len(s3.downloads(BUCKET)) == before + 1  # recorded under it: not read again


def test_reads_go_in_parallel_within_the_bound(s3, s3_env):
    """Objects are read several at a time, never more than S3_READS_IN_FLIGHT, results in order."""
    import threading
    import time

    from pipeline_assets.content import s3_source

    for n in range(20):
        _put(s3, f"docs/d{n:02d}.md", _text(n))
    source = open_source(SOURCE, Settings.from_env().source_config())
    items = list(source.items())
    lock, now, peak = threading.Lock(), [0], [0]
    real_get = source._get  # type: ignore[attr-defined]

    def counted(item, max_bytes):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        try:
            time.sleep(0.05)  # every read in flight at once overlaps the others
            return real_get(item, max_bytes)
        finally:
            with lock:
                now[0] -= 1

    source._get = counted  # type: ignore[attr-defined]
    read = list(source.read_all(items, 1 << 20))
    assert [i.document_id for i, _ in read] == [i.document_id for i in items]
    assert all(isinstance(data, bytes) for _, data in read)
    assert 1 < peak[0] <= s3_source.S3_READS_IN_FLIGHT
