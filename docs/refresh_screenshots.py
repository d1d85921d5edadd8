"""Refresh the UI screenshots in docs/ from the path the browser test checks.

    python docs/refresh_screenshots.py

Starts `pipeline-assets dev` on the bundled example (a fresh PIPELINE_HOME in a
temporary directory, the offline model: no key, no database server), waits for
the source sensor's run to embed the corpus, then opens the asset graph and one
partition's page in headless Chromium (pipeline_assets_tests/browser.py, the
same driver as test_dagster_webserver.py) and saves docs/asset-graph.png and
docs/partition.png.
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
from pipeline_assets.defs.partitions import bucket_key  # noqa: E402
from pipeline_assets.settings import DEFAULT_PARTITION_BUCKETS  # noqa: E402
from pipeline_assets_tests.browser import Browser  # noqa: E402

CORPUS = REPO / "examples" / "corpus"
# The bucket partition of one document of the example (partitions are document buckets).
PARTITION = bucket_key(bucket_of("databases/skip-locked-job-queues.md", DEFAULT_PARTITION_BUCKETS))
LOADED_TIMEOUT = 60.0   # seconds for every "Loading..." placeholder of a page to go
START_TIMEOUT = 180.0      # seconds for the webserver, the daemon and the sensor's first run


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
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["data"]


def _sensor_run_done(port: int) -> bool:
    try:
        runs = _gql(port, """{ runsOrError(filter: {tags: [{key: "pipeline/trigger", value: "source_documents"}]})
                              { ... on Runs { results { status } } } }""")["runsOrError"]["results"]
    except (OSError, KeyError, TypeError):
        return False
    return bool(runs) and all(r["status"] == "SUCCESS" for r in runs)


def main() -> int:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="screenshots-") as tmp:
        env = {k: v for k, v in os.environ.items() if not (k.startswith("PIPELINE_") or k.startswith("DAGSTER_"))}
        env.update(PIPELINE_HOME=str(Path(tmp) / "home"), PIPELINE_SOURCE_DIR=str(CORPUS))
        log = open(Path(tmp) / "dev.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "pipeline_assets.cli", "dev", "--port", str(port)],
                                env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not _sensor_run_done(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    print((Path(tmp) / "dev.log").read_text()[-3000:], file=sys.stderr)
                    print("error: the dev server did not embed the example in time", file=sys.stderr)
                    return 1
                time.sleep(2)
            base = f"http://127.0.0.1:{port}"
            with Browser() as browser:
                browser.open(f"{base}/asset-groups/embedding_pipeline")
                browser.wait_for_text("documents", "chunks", "embeddings", "Materialize all")
                browser.dismiss_community_dialog()
                _wait_loaded(browser)
                time.sleep(1.0)   # let the graph settle after the dialog closes
                graph = browser.screenshot(REPO / "docs" / "asset-graph.png")
                browser.open(f"{base}/assets/embeddings?view=partitions&partition="
                             f"{urllib.parse.quote(PARTITION, safe='')}")
                browser.wait_for_text("Latest materialization", "Metadata", "ready")
                _wait_loaded(browser)
                time.sleep(0.5)
                partition = browser.screenshot(REPO / "docs" / "partition.png")
            print(f"wrote {graph.relative_to(REPO)} and {partition.relative_to(REPO)}")
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
