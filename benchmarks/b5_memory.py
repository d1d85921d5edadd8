"""B5: memory stays flat as the corpus grows 10x.

Runs the real CLI's `ingest` and `work --until-idle` (offline local provider)
over N and 10*N documents, each in a fresh database, and reports every
process's peak RSS. Streaming everywhere (scan, ingest batches, claim batches,
export cursor) means the 10x corpus should cost about the same memory.

    python benchmarks/b5_memory.py [--documents 3000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, emit, fresh_database
from b3_rerun import write_corpus

# Runs a command and prints its peak RSS in KiB (ru_maxrss of the only child).
WRAP = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL);"
    " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
)
CLI = [sys.executable, "-m", "pipeline_assets.cli"]


def peak_rss_mb(args: list[str], env: dict) -> float:
    proc = subprocess.run(
        [sys.executable, "-c", WRAP, *CLI, *args], env=env, cwd=REPO, check=True, capture_output=True, text=True
    )
    return round(int(proc.stdout.strip().splitlines()[-1]) / 1024, 1)


def measure(n: int, env: dict) -> dict:
    with fresh_database(f"b5_{n}") as url, tempfile.TemporaryDirectory(prefix="b5-") as tmp:
        write_corpus(Path(tmp), n)
        env = {**env, "PIPELINE_DATABASE_URL": url}
        return {
            "documents": n,
            "ingest_peak_rss_mb": peak_rss_mb(["ingest", tmp], env),
            "work_peak_rss_mb": peak_rss_mb(["work", "--until-idle"], env),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=3000)
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_") and k != "PIPELINE_EMBEDDING_MODEL"}
    small, large = measure(args.documents, env), measure(args.documents * 10, env)
    out = {
        "benchmark": "b5_memory",
        "small": small,
        "large": large,
        "ingest_rss_ratio_10x": round(large["ingest_peak_rss_mb"] / small["ingest_peak_rss_mb"], 2),
        "work_rss_ratio_10x": round(large["work_peak_rss_mb"] / small["work_peak_rss_mb"], 2),
    }
    out["targets"] = {
        "rss_flat_within_1.25x": out["ingest_rss_ratio_10x"] <= 1.25 and out["work_rss_ratio_10x"] <= 1.25
    }
    emit(out)


if __name__ == "__main__":
    main()
