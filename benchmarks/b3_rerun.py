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
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, emit, fresh_database

from pipeline_assets.store import db

CLI = [sys.executable, "-m", "pipeline_assets.cli"]  # the `pipeline-assets` entry point
WORDS = (
    "lease heartbeat checksum chunk vector model provider retry backoff jitter queue ledger "
    "tombstone reconcile supersede revive export search coverage dead letter"
).split()


# Documents per folder of the corpus, and per task of the processes that write it.
FOLDER_DOCUMENTS = 1000


def document_text(i: int) -> str:
    """The text of document ``i`` (~1-3 kB: one or two chunks)."""
    words = [WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(150 + (i % 3) * 150)]
    return f"# Document {i}\n\n" + " ".join(words) + f"\n\nEnd {i}.\n"


def document_path(i: int) -> str:
    """Where document ``i`` is, under the corpus root (sorted paths are in the order of ``i``)."""
    return f"{i // FOLDER_DOCUMENTS:03d}/doc-{i:06d}.md"


def _write_folder(task: tuple[str, int, int]) -> None:
    root, start, stop = task
    (Path(root) / document_path(start)).parent.mkdir(parents=True)
    for i in range(start, stop):
        (Path(root) / document_path(i)).write_text(document_text(i))


def write_corpus(root: Path, n: int, processes: int = 0) -> None:
    """n distinct documents of ~1-3 kB (one or two chunks each), a folder per task in a pool of
    ``processes`` (0: one per usable core); nothing is held in memory (1M documents in minutes)."""
    tasks = [(str(root), start, min(start + FOLDER_DOCUMENTS, n)) for start in range(0, n, FOLDER_DOCUMENTS)]
    with multiprocessing.get_context("fork").Pool(processes or len(os.sched_getaffinity(0))) as pool:
        for _ in pool.imap_unordered(_write_folder, tasks):
            pass


def embed(directory: str, env: dict) -> tuple[dict, float]:
    started = time.perf_counter()
    proc = subprocess.run(
        [*CLI, "embed", directory, "--json"], env=env, cwd=REPO, check=True, stdout=subprocess.PIPE, text=True
    )
    return json.loads(proc.stdout), round(time.perf_counter() - started, 2)


def ledger_calls(url: str) -> int:
    with db.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM app.provider_calls").fetchone()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=10_000)
    args = p.parse_args()
    # The offline local provider, whatever the caller's environment says.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_") and k != "PIPELINE_EMBEDDING_MODEL"}
    with fresh_database("b3") as url, tempfile.TemporaryDirectory(prefix="b3-") as tmp:
        write_corpus(Path(tmp), args.documents)
        env["PIPELINE_DATABASE_URL"] = url
        first, t1 = embed(tmp, env)
        calls_after_first = ledger_calls(url)
        second, t2 = embed(tmp, env)
        calls_after_second = ledger_calls(url)
    out = {
        "benchmark": "b3_rerun",
        "documents": args.documents,
        "first": {"seconds": t1, "summary": first},
        "second": {"seconds": t2, "summary": second},
        "provider_calls_second_run": second["provider_calls"],
        "ledger_calls_added_by_second_run": calls_after_second - calls_after_first,
        "time_ratio_second_to_first": round(t2 / t1, 3),  # process wall time, start-up included
        # the CLI's own timer (after imports and start-up): ingest + work + status
        "time_ratio_in_process": round(second["seconds"] / first["seconds"], 3),
    }
    out["targets"] = {
        "provider_calls_second_run==0": second["provider_calls"] == 0 and calls_after_second == calls_after_first
    }
    emit(out)


if __name__ == "__main__":
    main()
