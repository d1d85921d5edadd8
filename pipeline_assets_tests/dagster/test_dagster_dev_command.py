"""`dagster dev` from the project root on a fresh checkout (no DAGSTER_HOME: Dagster's temporary
local storage, with the root dagster.yaml's shared settings), with the real test database and the
fake OpenAI server, as a Dagster user types it. The other Dagster commands: test_dagster_commands.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from pipeline_assets.defs.partitions import bucket_index
from pipeline_assets.store import reports
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.dagster_helpers import bucket_of
from pipeline_assets_tests.dagster_instances import DAGSTER, command_env
from pipeline_assets_tests.data_helpers import bucket_states
from pipeline_assets_tests.processes import REPO, stop_group

# dagster dev starts several Dagster processes (each imports Dagster: tens of seconds on a loaded
# machine): a generous deadline against a hang.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def setup(env, clean_db, tmp_path):
    with command_env(env, tmp_path) as prepared:
        yield prepared


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gql(port: int, query: str) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["data"]


def _poll(fn, timeout: float, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dagster dev exited ({proc.returncode}) while waiting for {what}"
        try:
            value = fn()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def test_dagster_dev_from_the_project_root_on_a_fresh_checkout(setup, conn, fake, tmp_path):
    """`dagster dev` with no DAGSTER_HOME: temporary local storage, the source sensor's one run over
    the span of the corpus's buckets, and the UI's GraphQL shows each bucket's own metadata."""
    run_env, corpus = setup
    port = _free_port()
    before = set(REPO.glob(".tmp_dagster_home_*"))
    log = open(tmp_path / "dagster-dev.log", "w")
    proc = subprocess.Popen(
        [*DAGSTER, "dev", "-w", "workspace.yaml", "-p", str(port)],
        env=run_env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    docs = [f"doc{i:04d}.md" for i in range(3)]
    keys = sorted(bucket_of(d) for d in docs)
    try:
        runs_q = """{ runsOrError(filter: {tags: [{key: "pipeline/trigger", value: "source_documents"}]}) {
                        ... on Runs { results { status jobName tags { key value } } } } }"""
        # The source sensor's bucket run, then the embeddings run embed_after_sync launches after it
        # (the model's key added by that sensor: nothing prepared this instance).
        runs = _poll(
            lambda: (
                (
                    done := [
                        r for r in _gql(port, runs_q)["runsOrError"]["results"] if r["status"] in ("SUCCESS", "FAILURE")
                    ]
                )
                and len(done) >= 2
                and done
            ),
            300,
            proc,
            "the source sensor's run and the embeddings run after it",
        )
        assert sorted((r["jobName"], r["status"]) for r in runs) == [
            ("embed_documents", "SUCCESS"),
            ("sync_documents", "SUCCESS"),
        ], runs
        (sync,) = [r for r in runs if r["jobName"] == "sync_documents"]
        tags = {t["key"]: t["value"] for t in sync["tags"]}
        first, last = tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]
        assert first <= keys[0] and keys[-1] <= last  # one range over (at least) the corpus's buckets
        assert tags["dagster/run_key"].startswith("sync@g0:3:")
        parts = json.dumps(keys)
        ui = _gql(
            port,
            """{ d: assetNodeOrError(assetKey: {path: ["documents"]}) {
                                   ... on AssetNode { dataVersionByPartition(partitions: PARTS)
                                     latestMaterializationByPartition(partitions: PARTS) {
                                       partition metadataEntries { label
                                         ... on TextMetadataEntry { text } ... on IntMetadataEntry { intValue } } } } }
                             e: assetNodeOrError(assetKey: {path: ["embeddings"]}) {
                                   ... on AssetNode { staleStatusByPartition(partitions: CELLS) } } }""".replace(
                "PARTS", parts
            ).replace("CELLS", json.dumps([f"{k}|openai/{FAKE_MODEL}" for k in keys])),
        )
        summaries = reports.document_summaries(conn, str(corpus.resolve()), docs)
        assert sorted(summaries) == docs and all(s.status == "current" for s in summaries.values())
        # One run over the range: one data version for all its buckets (Dagster records one per
        # result), and each bucket's own digest and counts in its metadata; nothing looks stale.
        versions = ui["d"]["dataVersionByPartition"]
        assert len(set(versions)) == 1 and versions[0].startswith(
            f"range:{bucket_index(last) - bucket_index(first) + 1}:"
        )
        for event in ui["d"]["latestMaterializationByPartition"]:
            meta = {m["label"]: m.get("text", m.get("intValue")) for m in event["metadataEntries"]}
            (doc,) = [d for d in docs if bucket_of(d) == event["partition"]]
            b = bucket_index(event["partition"])
            assert meta["text_digest"] == bucket_states({doc: summaries[doc]}, [b], 64)[b].text_digest
            assert (meta["documents"], meta["current"]) == (1, 1)
        assert ui["e"]["staleStatusByPartition"] == ["FRESH"] * len(keys)
    finally:
        # dagster dev's own clean shutdown (SIGINT), then its whole process group: its code server
        # (and that one's gRPC child) outlive it, re-parented, and ignore SIGTERM.
        stop_group(proc, signal.SIGINT, grace=60)
        log.close()
        # Its temporary storage: dagster dev removes it on exit, unless a child still writes
        # to it then ("Directory not empty"); what this run created goes.
        for leftover in set(REPO.glob(".tmp_dagster_home_*")) - before:
            shutil.rmtree(leftover, ignore_errors=True)
