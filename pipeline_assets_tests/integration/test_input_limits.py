"""Per-model input windows: a chunk size that could exceed a model's window is
refused with one line naming both numbers and the setting, before any provider call, at every
entry point (`embed`, `work`, `models add`, `settings`); usage that shows a server truncating
surfaces in `status`. Real PostgreSQL, the real CLI, providers as real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from pipeline_assets.app.model_runtime import runtime_for_model
from pipeline_assets.app.runtime import Runtime, chunker_for, chunking
from pipeline_assets.providers import ChunkTooLarge, ModelLimit, ModelSpec, check_chunk_size, provider_for
from pipeline_assets.providers.limits import FOREIGN_TOKENS_PER_CHUNK_TOKEN
from pipeline_assets.registry import models
from pipeline_assets.settings import Settings
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli

MODEL_ID = f"openai/{FAKE_MODEL}"


def one_line_error(proc) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


# -- the rule ---------------------------------------------------------------------------------


def test_a_cl100k_window_is_exact_and_a_foreign_one_is_bounded():
    openai_model = ModelSpec(
        provider="openai", name="m", dimension=4, max_input_tokens=8191, max_batch_inputs=1, max_batch_tokens=1
    )
    assert openai_model.max_chunk_tokens == 8191
    bert = ModelSpec(
        provider="onnx",
        name="m",
        dimension=4,
        max_input_tokens=256,
        max_batch_inputs=1,
        max_batch_tokens=1,
        tokenizer="WordPiece",
        tokens_per_chunk_token=1.5,
        special_tokens=2,
    )
    assert bert.max_chunk_tokens == 169  # (256 - [CLS] - [SEP]) / 1.5
    check_chunk_size(169, [ModelLimit.of(bert), ModelLimit.of(openai_model)])
    with pytest.raises(ChunkTooLarge) as refused:
        check_chunk_size(512, [ModelLimit.of(openai_model), ModelLimit.of(bert)])
    message = str(refused.value)
    assert "\n" not in message
    assert "PIPELINE_CHUNK_TOKENS=512" in message and "256 WordPiece tokens" in message
    assert "PIPELINE_CHUNK_TOKENS=169 or less" in message and "onnx/m@4" in message


def test_a_server_models_window_comes_from_its_setting():
    base = {"OPENAI_API_KEY": "k", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}

    def provider(**env: str):
        return provider_for(Settings.from_env({**base, **env}).provider_config())

    known = provider(PIPELINE_EMBEDDING_MODEL="text-embedding-3-small")
    assert (known.spec.max_input_tokens, known.spec.max_chunk_tokens, known.spec.tokenizer) == (8191, 8191, "cl100k")
    assert known.window_known
    unknown = provider(PIPELINE_EMBEDDING_MODEL="bge-small")
    assert not unknown.window_known  # `settings` warns about it
    server = provider(PIPELINE_EMBEDDING_MODEL="bge-small", PIPELINE_MODEL_MAX_INPUT_TOKENS="256")
    assert server.spec.max_input_tokens == 256
    assert server.spec.max_chunk_tokens == int((256 - 2) / FOREIGN_TOKENS_PER_CHUNK_TOKEN)
    assert server.spec.model_id == unknown.spec.model_id  # the window never changes a vector
    for p in (known, unknown, server):
        p.close()


# -- refused before any call, at every entry point ----------------------------------------------


def test_the_default_chunk_size_follows_the_configured_models_window():
    base = {"OPENAI_API_KEY": "k", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    assert chunking(Settings.from_env({})) == (512, 64)  # the hashing model: 8191 cl100k tokens
    small = Settings.from_env(
        {**base, "PIPELINE_EMBEDDING_MODEL": "bge-small", "PIPELINE_MODEL_MAX_INPUT_TOKENS": "256"}
    )
    assert chunking(small) == (169, 21)  # (256 - 2) / 1.5, and the same eighth of it overlapping
    assert chunker_for(small).version == "tok-window-1/cl100k/169/21"
    assert chunking(small.replace(chunk_overlap=30)) == (169, 30)
    # Set, the size is kept as it is (an over-large one is refused, never shrunk), the overlap is 64.
    assert chunking(small.replace(chunk_tokens=300)) == (300, 64)
    with pytest.raises(ChunkTooLarge, match="PIPELINE_CHUNK_TOKENS=300 is too large"):
        Runtime.build(small.replace(chunk_tokens=300))
    rt = Runtime.build(small)
    assert (rt.settings.chunk_tokens, rt.settings.chunk_overlap, rt.options.chunker.max_tokens) == (169, 21, 169)
    # Another model's runtime (`models add`) chunks as the configured model does.
    assert runtime_for_model(small, "text-embedding-3-small").options.chunker.version == rt.options.chunker.version
    rt.provider.close()


@pytest.fixture
def small_window(env, clean_db):
    """The fake server's model declared with a 256-token window (as for a MiniLM behind TEI), and a
    chunk size set past it (unset, it would follow the window)."""
    return {**env, "PIPELINE_MODEL_MAX_INPUT_TOKENS": "256", "PIPELINE_CHUNK_TOKENS": "512"}


def test_embed_with_512_token_chunks_and_a_256_token_model_is_refused_before_any_call(
    small_window, fake, conn, tmp_path
):
    write_corpus(tmp_path / "c", 3)
    line = one_line_error(cli("embed", str(tmp_path / "c"), env=small_window, check=False))
    assert line == (
        f"error: PIPELINE_CHUNK_TOKENS=512 is too large for model {MODEL_ID}: its input window is "
        "256 model tokens, which fits at most 169 cl100k tokens; set PIPELINE_CHUNK_TOKENS=169 or "
        "less (inputs are never truncated)"
    )
    assert fake.stats["requests"] == 0
    assert conn.execute("SELECT count(*) FROM app.documents").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM app.provider_calls").fetchone()[0] == 0
    # Within the window, the same corpus embeds.
    ok = {**small_window, "PIPELINE_CHUNK_TOKENS": "169"}
    cli("embed", str(tmp_path / "c"), env=ok)
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 3
    row = conn.execute(
        "SELECT max_input_tokens, max_chunk_tokens, tokenizer FROM app.models WHERE model_id = %s", (MODEL_ID,)
    ).fetchone()
    assert row == (256, 169, "model")


def test_settings_checks_the_configured_and_every_active_model(small_window, conn):
    proc = cli("settings", env=small_window, check=False)
    assert "PIPELINE_CHUNK_TOKENS=512 is too large for model" in one_line_error(proc)
    assert f"input window {MODEL_ID} (configured): 256 model tokens" in proc.stdout
    fits = cli("settings", "--json", env={**small_window, "PIPELINE_CHUNK_TOKENS": "160"})
    report = json.loads(fits.stdout)["input_limits"]
    assert report["error"] is None and [m["fits"] for m in report["models"]] == [True]
    # An active model in the database with a smaller window is checked too.
    models.ensure_model(
        conn,
        ModelSpec(
            provider="test", name="tiny", dimension=4, max_input_tokens=100, max_batch_inputs=1, max_batch_tokens=1
        ),
    )
    proc = cli("settings", env={**small_window, "PIPELINE_CHUNK_TOKENS": "160"}, check=False)
    assert one_line_error(proc) == (
        "error: PIPELINE_CHUNK_TOKENS=160 is too large for model test/tiny@4: its "
        "input window is 100 tokens; set PIPELINE_CHUNK_TOKENS=100 or less "
        "(inputs are never truncated)"
    )


def test_worker_start_checks_every_active_model(env, clean_db, conn, fake, tmp_path):
    write_corpus(tmp_path / "c", 2)
    cli("ingest", str(tmp_path / "c"), env=env)
    models.ensure_model(
        conn,
        ModelSpec(
            provider="test", name="tiny", dimension=4, max_input_tokens=100, max_batch_inputs=1, max_batch_tokens=1
        ),
    )
    before = conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1 ORDER BY 1").fetchall()
    line = one_line_error(cli("work", "--until-idle", env=env, check=False))
    assert "PIPELINE_CHUNK_TOKENS=512 is too large for model test/tiny@4" in line
    assert fake.stats["requests"] == 0
    assert conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1 ORDER BY 1").fetchall() == before


def test_models_add_refuses_a_model_whose_window_the_chunks_exceed(small_window, conn, fake, tmp_path):
    write_corpus(tmp_path / "c", 2)
    ingest_env = {k: v for k, v in small_window.items() if k != "PIPELINE_MODEL_MAX_INPUT_TOKENS"}
    cli("ingest", str(tmp_path / "c"), env=ingest_env)  # the fake model, window unknown: 8191 assumed
    jobs = conn.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0]
    line = one_line_error(cli("models", "add", "other-model", env=small_window, check=False))
    assert "PIPELINE_CHUNK_TOKENS=512 is too large for model openai/other-model: its input window is 256" in line
    assert conn.execute("SELECT count(*) FROM app.models WHERE name = 'other-model'").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0] == jobs
    assert fake.stats["requests"] == 0


# -- a server that truncates: its usage shows it, `status` says so -------------------------------

WINDOW = 64


class _TruncatingHandler(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that, like infinity or TEI, silently cuts every input at its
    window; it counts a token per 2 bytes (finer than cl100k) and reports the tokens it kept."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        data, kept = [], 0
        for i, text in enumerate(body["input"]):
            raw = text.encode()
            pieces = [raw[j : j + 2] for j in range(0, len(raw), 2)][:WINDOW]
            kept += len(pieces)
            seed = int.from_bytes(hashlib.sha256(b"".join(pieces)).digest()[:8], "little")
            vec = np.random.default_rng(seed).standard_normal(8)
            data.append({"object": "embedding", "index": i, "embedding": (vec / np.linalg.norm(vec)).tolist()})
        out = json.dumps(
            {
                "object": "list",
                "data": data,
                "model": body["model"],
                "usage": {"prompt_tokens": kept, "total_tokens": kept},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def truncating_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _TruncatingHandler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_status_shows_usage_that_reveals_truncation(env, clean_db, conn, truncating_server, tmp_path):
    # Long common words: one cl100k token each, several of the server's 2-byte tokens.
    (tmp_path / "c").mkdir()
    words = "international development organization information environmental responsibility".split()
    for i in range(3):
        (tmp_path / "c" / f"d{i}.md").write_text(" ".join(words[(i + j) % len(words)] for j in range(120)) + "\n")
    server_env = {
        **env,
        "OPENAI_BASE_URL": truncating_server,
        "PIPELINE_EMBEDDING_MODEL": "cutting-model",
        "PIPELINE_MODEL_MAX_INPUT_TOKENS": str(WINDOW),
        "PIPELINE_CHUNK_TOKENS": "40",
        "PIPELINE_CHUNK_OVERLAP": "4",
        "PIPELINE_BATCH_INPUTS": "1",
    }
    cli("embed", str(tmp_path / "c"), env=server_env)
    chunks = conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == chunks
    status = json.loads(cli("status", "--json", env=server_env).stdout)
    (limit,) = [m for m in status["input_limits"] if m["model_id"] == "openai/cutting-model"]
    assert limit["max_input_tokens"] == WINDOW and limit["max_chunk_tokens"] == 41
    assert limit["chunks_over_window"] == 0  # the chunk size fits: the server's tokenizer is what cut them
    cut = conn.execute(
        "SELECT count(DISTINCT chunk_checksum) FROM app.chunks WHERE (octet_length(text) + 1) / 2 >= %s", (WINDOW,)
    ).fetchone()[0]
    assert cut > 0 and limit["truncated_inputs"] == limit["truncated_calls"] == cut
    text = cli("status", env=server_env).stdout
    assert "input window openai/cutting-model: 64 model tokens" in text
    assert "shows inputs truncated at the window" in text


# -- a server's model with no known window: refused until it is given -----------------------------

WINDOW_LINE = (
    "the input window of model {model} is unknown (not one of the provider's models); set "
    "PIPELINE_MODEL_MAX_INPUT_TOKENS to it, in the model's own tokens (512 for e5-small or bge-small), "
    "so that no chunk is truncated by the server"
)


@pytest.fixture
def no_window(env, clean_db):
    """The fake server's model with no PIPELINE_MODEL_MAX_INPUT_TOKENS: its window is nobody's knowledge."""
    return {k: v for k, v in env.items() if k != "PIPELINE_MODEL_MAX_INPUT_TOKENS"}


def test_a_model_without_a_known_window_is_refused_at_models_add_and_worker_start(
    no_window, conn, fake, tmp_path, monkeypatch
):
    import dagster as dg

    from pipeline_assets_tests.dagster_helpers import bucket_of, execute, fresh_defs

    write_corpus(tmp_path / "c", 2)
    line = one_line_error(cli("models", "add", "bge-small", env=no_window, check=False))
    assert line == "error: " + WINDOW_LINE.format(model="openai/bge-small")
    assert conn.execute("SELECT count(*) FROM app.models").fetchone()[0] == 0
    # `embed` refuses before it ingests; `work` before it claims.
    line = one_line_error(cli("embed", str(tmp_path / "c"), env=no_window, check=False))
    assert line == "error: " + WINDOW_LINE.format(model=MODEL_ID)
    assert conn.execute("SELECT count(*) FROM app.documents").fetchone()[0] == 0
    cli("ingest", str(tmp_path / "c"), env=no_window)  # no provider call: not refused
    jobs = conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall()
    assert jobs == [("pending", 2)]
    line = one_line_error(cli("work", "--until-idle", env=no_window, check=False))
    assert line == "error: " + WINDOW_LINE.format(model=MODEL_ID)
    # The Dagster embeddings step, in its run: one line, nothing sent.
    for key in list(no_window):
        if key.startswith(("PIPELINE_", "OPENAI_")):
            monkeypatch.setenv(key, no_window[key])
    monkeypatch.delenv("PIPELINE_MODEL_MAX_INPUT_TOKENS", raising=False)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(tmp_path / "c"))
    result = execute(fresh_defs(), dg.DagsterInstance.ephemeral(), partition_key=bucket_of("doc0000.md"))
    assert not result.success
    assert result.failure_data_for_node("embeddings").user_failure_data.description == WINDOW_LINE.format(
        model=MODEL_ID
    )
    assert fake.stats["requests"] == 0
    assert conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall() == jobs
    # Given the window, the same model works; `settings` names the setting while it is missing.
    assert "PIPELINE_MODEL_MAX_INPUT_TOKENS" in cli("settings", env=no_window).stdout
    cli("work", "--until-idle", env={**no_window, "PIPELINE_MODEL_MAX_INPUT_TOKENS": "8191"})
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 2


def test_the_offline_model_needs_no_window_setting(env, clean_db, conn, tmp_path):
    """The quick start (no key: the offline model, whose window is known) works with nothing set."""
    offline = {
        k: v
        for k, v in env.items()
        if not k.startswith("OPENAI_") and k not in ("PIPELINE_EMBEDDING_MODEL", "PIPELINE_MODEL_MAX_INPUT_TOKENS")
    }
    write_corpus(tmp_path / "c", 2)
    cli("embed", str(tmp_path / "c"), env=offline)
    (model,) = [r[0] for r in conn.execute("SELECT model_id FROM app.models")]
    assert model.startswith("local/") and conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 2
    cli("models", "add", "local-hashing", env=offline)
