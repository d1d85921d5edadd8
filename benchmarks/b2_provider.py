"""B2: provider-bound throughput against a rate-limited fake OpenAI server.

The fake (pipeline_assets_tests.fake_openai, process mode) answers after 200 ms
and enforces 3,000 requests/min and 1,000,000 tokens/min over a sliding 60 s
window (429 with Retry-After, not billed). Two real worker processes
(`pipeline-assets work --until-idle`) drain a corpus sized to last ~60-90 s at
the token limit. Reported, from the fake's /_stats: billed tokens per minute of
the workers' wall time / the limit (target >= 0.9) and the share of requests
answered 429 (target <= 1%).

    python benchmarks/b2_provider.py [--documents 5600] [--concurrency 6] [--batch-inputs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, emit, fresh_database, start_fake

from pipeline_assets.store import db
from pipeline_assets_tests.fake_openai_wire import count_tokens, fetch_stats

RPM, TPM, LATENCY, DIM = 3000, 1_000_000, 0.2, 64
CLI = [sys.executable, "-m", "pipeline_assets.cli"]  # the `pipeline-assets` entry point


def write_corpus(root: Path, n: int) -> int:
    """n distinct ~1 kB documents (one chunk each); returns their fake-token total."""
    filler = (
        "Rate limits are the provider's state, not the item's: a 429 pauses every worker "
        "and defers the batch without consuming an attempt. "
    )
    total = 0
    for i in range(n):
        folder = root / f"{i // 1000:03d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        text = f"Document {i}.\n" + filler * 7 + f"\nEnd of document {i}.\n"
        (folder / f"doc-{i:06d}.txt").write_text(text)
        total += count_tokens(text)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=5600)
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight per worker process")
    p.add_argument("--batch-inputs", type=int, default=2, help="PIPELINE_BATCH_INPUTS")
    p.add_argument("--batch-tokens", type=int, default=100_000, help="PIPELINE_BATCH_TOKENS")
    args = p.parse_args()
    out: dict = {
        "benchmark": "b2_provider",
        "fake": {"latency_s": LATENCY, "rpm_limit": RPM, "tpm_limit": TPM, "dim": DIM},
        "workers": {
            "processes": 2,
            "concurrency": args.concurrency,
            "PIPELINE_BATCH_INPUTS": args.batch_inputs,
            "PIPELINE_BATCH_TOKENS": args.batch_tokens,
        },
    }
    fake, base_url = start_fake("--dim", str(DIM), "--latency", str(LATENCY), "--rpm", str(RPM), "--tpm", str(TPM))
    try:
        with fresh_database("b2") as url, tempfile.TemporaryDirectory(prefix="b2-") as tmp:
            corpus_tokens = write_corpus(Path(tmp), args.documents)
            out["corpus"] = {
                "documents": args.documents,
                "fake_tokens": corpus_tokens,
                "seconds_at_tpm_limit": round(corpus_tokens / TPM * 60, 1),
            }
            env = os.environ | {
                "PIPELINE_DATABASE_URL": url,
                "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": "test-key",
                "PIPELINE_EMBEDDING_MODEL": "fake-embed",
                "PIPELINE_MODEL_MAX_INPUT_TOKENS": "8191",
                "PIPELINE_BATCH_INPUTS": str(args.batch_inputs),
                "PIPELINE_BATCH_TOKENS": str(args.batch_tokens),
            }
            subprocess.run([*CLI, "ingest", tmp], env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            started = time.monotonic()
            workers = [
                subprocess.Popen(
                    [
                        *CLI,
                        "work",
                        "--until-idle",
                        "--json",
                        "--concurrency",
                        str(args.concurrency),
                        "--worker-id",
                        f"b2-{i}",
                    ],
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for i in range(2)
            ]
            reports = [w.communicate(timeout=600)[0] for w in workers]
            seconds = time.monotonic() - started
            stats = fetch_stats(base_url, brief=True)
            with db.connect(url) as conn:
                jobs = dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall())
            out["exit_codes"] = [w.returncode for w in workers]
    finally:
        fake.terminate()
        fake.wait(10)

    requests = stats["requests"]
    tokens_per_min = stats["billed_tokens"] / seconds * 60
    out["result"] = {
        "seconds": round(seconds, 1),
        "requests": requests,
        "responses_by_status": stats["responses_by_status"],
        "billed_tokens": stats["billed_tokens"],
        "billed_inputs": stats["billed_inputs"],
        "jobs": jobs,
        "tokens_per_min": round(tokens_per_min),
        "requests_per_min": round(requests / seconds * 60),
    }
    out["tpm_utilisation"] = round(tokens_per_min / TPM, 3)
    out["share_429"] = round(stats["rate_limited"] / requests, 4) if requests else None
    out["targets"] = {
        "tpm_utilisation>=0.9": out["tpm_utilisation"] >= 0.9,
        "share_429<=0.01": out["share_429"] is not None and out["share_429"] <= 0.01,
    }
    out["worker_reports"] = [json.loads(r) if r.strip() else None for r in reports]
    emit(out)


if __name__ == "__main__":
    main()
