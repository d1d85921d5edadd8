"""Refresh the UI screenshots in docs/ from the path the browser test checks.

    python docs/refresh_screenshots.py

Starts `pipeline-assets dev` on the bundled example (a fresh PIPELINE_HOME in a temporary directory, the
offline model: no database server), waits for the source sensor's bucket run and the embeddings run
after it, then opens the asset graph and one partition's page in headless Chromium
(pipeline_assets_tests/browser.py, test_dagster_webserver.py's driver) and saves docs/asset-graph.png
and docs/partition.png. Then the model-switch walk-through: `pipeline-assets models add` a second model
(text-embedding-3-small, answered by pipeline_assets_tests/fake_openai.py: no key, no network), a
backfill of half of its column through GraphQL, and docs/model-columns.png (the offline model's column
full, the new one half filled in).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline_assets.app.buckets import bucket_of  # noqa: E402
from pipeline_assets.defs.dagster_config import DEFAULT_PARTITION_BUCKETS  # noqa: E402
from pipeline_assets.defs.partitions import bucket_key  # noqa: E402
from pipeline_assets_tests.browser import Browser  # noqa: E402
from pipeline_assets_tests.fake_openai import FakeOpenAI  # noqa: E402

CORPUS = REPO / "examples" / "corpus"
# The bucket partition of one document of the example (partitions are document buckets).
PARTITION = bucket_key(bucket_of("databases/skip-locked-job-queues.md", DEFAULT_PARTITION_BUCKETS))
LOADED_TIMEOUT = 60.0  # seconds for every "Loading..." placeholder of a page to go
START_TIMEOUT = 180.0  # seconds for the webserver, the daemon and the sensor's first run
NEW_MODEL = "text-embedding-3-small"
NEW_MODEL_DIM = 1536


def _wait_loaded(browser: Browser) -> None:
    """Until no "Loading..." placeholder is left on the page (the asset nodes fill in late)."""
    deadline = time.monotonic() + LOADED_TIMEOUT
    while "Loading..." in browser.text():
        if time.monotonic() > deadline:
            raise TimeoutError('the page still shows "Loading..."')
        time.sleep(0.5)


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


def _sensor_runs_done(port: int) -> bool:
    """The source sensor's bucket run and the embeddings run after it (same trigger tag) succeeded."""
    try:
        runs = _gql(
            port,
            """{ runsOrError(filter: {tags: [{key: "pipeline/trigger", value: "source_documents"}]})
                              { ... on Runs { results { status jobName } } } }""",
        )["runsOrError"]["results"]
    except (OSError, KeyError, TypeError):
        return False
    return {r["jobName"] for r in runs} == {"sync_documents", "embed_documents"} and all(
        r["status"] == "SUCCESS" for r in runs
    )


def _model_keys(port: int) -> list[str]:
    try:
        dims = _gql(
            port,
            """{ assetNodeOrError(assetKey: {path: ["embeddings"]}) { ... on AssetNode {
                               partitionKeysByDimension { name partitionKeys } } } }""",
        )
    except (OSError, KeyError, TypeError):
        return []
    return next(
        (d["partitionKeys"] for d in dims["assetNodeOrError"]["partitionKeysByDimension"] if d["name"] == "model"), []
    )


def _wait(predicate, proc: subprocess.Popen, what: str, timeout: float = START_TIMEOUT):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not in {timeout:.0f} s")
        time.sleep(2)
    return value


def _backfill_half_column(port: int, proc: subprocess.Popen, model: str) -> None:
    """A backfill of buckets b000..b031 of one model's column; waits until its runs succeeded."""
    half = bucket_key(DEFAULT_PARTITION_BUCKETS // 2 - 1)
    launched = _gql(
        port,
        """mutation { launchPartitionBackfill(backfillParams: {partitionsByAssets: [
                               {assetKey: {path: ["embeddings"]}, partitions: {range: {start: "START", end: "END"}}}]})
                               { __typename ... on LaunchBackfillSuccess { backfillId } } }""".replace(
            "START", f"{bucket_key(0)}|{model}"
        ).replace("END", f"{half}|{model}"),
    )
    backfill = launched["launchPartitionBackfill"]["backfillId"]

    def done() -> bool:
        runs = _gql(
            port,
            """{ runsOrError(filter: {tags: [{key: "dagster/backfill", value: "ID"}]})
                              { ... on Runs { results { status } } } }""".replace("ID", backfill),
        )["runsOrError"]["results"]
        if any(r["status"] in ("FAILURE", "CANCELED") for r in runs):
            raise RuntimeError(f"the backfill of {model}'s column failed")
        return bool(runs) and all(r["status"] == "SUCCESS" for r in runs)

    _wait(done, proc, "the backfill of the new column")


def main() -> int:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="screenshots-") as tmp, FakeOpenAI(dim=NEW_MODEL_DIM) as fake:
        env = {k: v for k, v in os.environ.items() if not (k.startswith("PIPELINE_") or k.startswith("DAGSTER_"))}
        env.update(
            PIPELINE_HOME=str(Path(tmp) / "home"),
            PIPELINE_SOURCE_DIR=str(CORPUS),
            PIPELINE_EMBEDDING_MODEL="local-hashing",  # the offline model is the configured one
            OPENAI_API_KEY="test-key",
            OPENAI_BASE_URL=fake.base_url,
        )  # the second model's stand-in
        log = open(Path(tmp) / "dev.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline_assets.cli", "dev", "--port", str(port)],
            env=env,
            cwd=tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            try:
                _wait(lambda: _sensor_runs_done(port), proc, "the example embedded by the sensors' runs")
                (model,) = _wait(lambda: _model_keys(port), proc, "the model column")
            except TimeoutError as exc:
                print((Path(tmp) / "dev.log").read_text()[-3000:], file=sys.stderr)
                print(f"error: {exc}", file=sys.stderr)
                return 1
            base = f"http://127.0.0.1:{port}"
            with Browser() as browser:
                browser.open(f"{base}/asset-groups/embedding_pipeline")
                browser.wait_for_text("documents", "chunks", "embeddings", "Materialize all")
                browser.dismiss_community_dialog()
                _wait_loaded(browser)
                time.sleep(1.0)  # let the graph settle after the dialog closes
                graph = browser.screenshot(REPO / "docs" / "asset-graph.png")
                browser.open(
                    f"{base}/assets/embeddings?view=partitions&partition="
                    f"{urllib.parse.quote(f'{PARTITION}|{model}', safe='')}"
                )
                browser.wait_for_text("Latest materialization", "Metadata", "ready")
                _wait_loaded(browser)
                time.sleep(0.5)
                partition = browser.screenshot(REPO / "docs" / "partition.png")
                # The model-switch walk-through: a second model, half of its column backfilled.
                subprocess.run(
                    [sys.executable, "-m", "pipeline_assets.cli", "models", "add", NEW_MODEL],
                    env=env,
                    cwd=tmp,
                    check=True,
                    capture_output=True,
                )
                keys = _wait(lambda: len(k := _model_keys(port)) == 2 and k, proc, "the new model's column")
                new = next(k for k in keys if k != model)
                _backfill_half_column(port, proc, new)
                browser.open(f"{base}/assets/embeddings?view=partitions")
                browser.wait_for_text("Materialized (", "Missing (", new)
                _wait_loaded(browser)
                time.sleep(1.0)
                columns = browser.screenshot(REPO / "docs" / "model-columns.png")
            print(f"wrote {graph.relative_to(REPO)}, {partition.relative_to(REPO)} and {columns.relative_to(REPO)}")
            return 0
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=45)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            log.close()


if __name__ == "__main__":
    sys.exit(main())
