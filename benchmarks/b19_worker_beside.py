"""B19 (index policy): a long-running `work` beside `ingest DIR`, until every chunk is ready and
the model's index valid, for one or more checkouts side by side (alternating, fresh database each,
one zero-latency fake). Prints per run: done_s (start to all ready and the index valid),
ingest_s (the ingest process's exit) and index_first_seen_s (when the index first existed).

    python benchmarks/b19_worker_beside.py --docs 10000 --rounds 2 --checkouts /work/main,.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from _common import REPO, emit, fresh_database, settle, start_fake
from _sdk_alone import KEY
from b1_cli_sdk import cli_env
from b3_rerun import write_corpus

CLI = [sys.executable, "-m", "pipeline_assets.cli"]
POLL_SECONDS = 0.1
TIMEOUT_SECONDS = 1800


def one_run(corpus: Path, env: dict, checkout: str, url: str) -> dict:
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, "cwd": checkout}
    started = time.monotonic()
    ingest = subprocess.Popen([*CLI, "ingest", str(corpus)], **quiet)
    worker = subprocess.Popen([*CLI, "work"], **quiet)
    ingest_s = index_s = None
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            while time.monotonic() - started < TIMEOUT_SECONDS:
                if ingest_s is None and ingest.poll() is not None:
                    ingest_s = time.monotonic() - started
                valid = conn.execute(
                    "SELECT bool_and(i.indisvalid) FROM pg_index i JOIN pg_class x"
                    " ON x.oid = i.indexrelid WHERE x.relname LIKE 'embeddings_hnsw_%'"
                ).fetchone()[0]
                if valid is not None and index_s is None:
                    index_s = time.monotonic() - started
                if ingest_s is not None and valid:
                    chunks, ready = conn.execute(
                        "SELECT (SELECT count(*) FROM app.chunks), (SELECT count(*)"
                        " FROM app.embedding_jobs WHERE status = 'ready')"
                    ).fetchone()
                    if ready == chunks:
                        break
                time.sleep(POLL_SECONDS)
        done = time.monotonic() - started
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        ingest.wait(60)
    return {
        "checkout": checkout,
        "done_s": round(done, 2),
        "ingest_s": round(ingest_s or 0, 2),
        "index_first_seen_s": round(index_s or 0, 2),
        "load_average": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--checkouts", default=str(REPO), help="comma-separated checkouts to run the CLI from")
    a = p.parse_args()
    checkouts = [str(Path(c).resolve()) for c in a.checkouts.split(",")]
    fake, base_url = start_fake("--dim", str(a.dim), "--api-key", KEY)
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="b19b-") as tmp:
            corpus = Path(tmp) / "corpus"
            write_corpus(corpus, a.docs)
            for _ in range(a.rounds):
                for checkout in checkouts:
                    with fresh_database("beside") as url:
                        settle(url)
                        runs.append(one_run(corpus, cli_env(url, base_url, a.dim), checkout, url))
    finally:
        fake.terminate()
        fake.wait(10)
    emit({"docs": a.docs, "dim": a.dim, "rounds": a.rounds, "runs": runs})


if __name__ == "__main__":
    main()
