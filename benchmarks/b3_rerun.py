"""B3: re-running `embed` over an unchanged 10,000-document corpus.

Runs the real CLI (`pipeline-assets embed DIR --json`) twice against a fresh
database with the offline local provider. The second run must make no
provider call (counted both from the CLI summary and from the spend ledger,
app.provider_calls) and should take a fraction of the first run's time.

    python benchmarks/b3_rerun.py [--documents 10000]
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

from _common import REPO, emit, fresh_database

from pipeline_assets.store import db

CLI = [sys.executable, "-m", "pipeline_assets.cli"]  # the `pipeline-assets` entry point
WORDS = ("lease heartbeat checksum chunk vector model provider retry backoff jitter queue ledger "
         "tombstone reconcile supersede revive export search coverage dead letter").split()


def write_corpus(root: Path, n: int) -> None:
    """n distinct documents of ~1-3 kB (one or two chunks each)."""
    for i in range(n):
        folder = root / f"{i // 1000:03d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        words = [WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(150 + (i % 3) * 150)]
        (folder / f"doc-{i:06d}.md").write_text(f"# Document {i}\n\n" + " ".join(words) + f"\n\nEnd {i}.\n")


def embed(directory: str, env: dict) -> tuple[dict, float]:
    started = time.perf_counter()
    proc = subprocess.run([*CLI, "embed", directory, "--json"], env=env, cwd=REPO, check=True,
                          stdout=subprocess.PIPE, text=True)
    return json.loads(proc.stdout), round(time.perf_counter() - started, 2)


def ledger_calls(url: str) -> int:
    with db.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM app.provider_calls").fetchone()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=10_000)
    args = p.parse_args()
    # The offline local provider, whatever the caller's environment says.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OPENAI_") and k != "PIPELINE_EMBEDDING_MODEL"}
    with fresh_database("b3") as url, tempfile.TemporaryDirectory(prefix="b3-") as tmp:
        write_corpus(Path(tmp), args.documents)
        env["PIPELINE_DATABASE_URL"] = url
        first, t1 = embed(tmp, env)
        calls_after_first = ledger_calls(url)
        second, t2 = embed(tmp, env)
        calls_after_second = ledger_calls(url)
    out = {
        "benchmark": "b3_rerun", "documents": args.documents,
        "first": {"seconds": t1, "summary": first},
        "second": {"seconds": t2, "summary": second},
        "provider_calls_second_run": second["provider_calls"],
        "ledger_calls_added_by_second_run": calls_after_second - calls_after_first,
        "time_ratio_second_to_first": round(t2 / t1, 3),  # process wall time, start-up included
        # the CLI's own timer (after imports and start-up): ingest + work + status
        "time_ratio_in_process": round(second["seconds"] / first["seconds"], 3),
    }
    out["targets"] = {"provider_calls_second_run==0": second["provider_calls"] == 0
                      and calls_after_second == calls_after_first}
    emit(out)


if __name__ == "__main__":
    main()
