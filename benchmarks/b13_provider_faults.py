"""B13: a flaky provider and a provider outage, against a plain retrying client.

The fake OpenAI server (process mode) with faults drawn per request, seeded per run (``harsh``,
``mild``): the real worker (`pipeline-assets work --until-idle`) against the openai SDK with
``max_retries=0`` resending each request after its Retry-After; medians over ``--runs`` of first
request to last answer and the ratio worker / baseline (target <= 2). ``outage``: 503 to everything
until the breaker has tripped and ``--outage-seconds`` more have passed; seconds from recovery to the
first request (target <= 10) and to every job ready (target <= 15). The fault mixes, the corpus and
each key: benchmarks/README.md, B13.

    python benchmarks/b13_provider_faults.py [--runs 3] [--outage-seconds 40] [--skip-outage]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
from _common import REPO, emit, fresh_database, start_fake

from pipeline_assets.store import db
from pipeline_assets_tests.fake_openai_wire import fetch_stats, post_faults

DIM = 64
MODEL = "fake-embed"
BATCH = 256  # the worker's default PIPELINE_BATCH_INPUTS
THREADS = 4  # the worker's default concurrency
MIXES = {"harsh": [[0.5, 429, "1"], [0.3, 500, None]], "mild": [[0.3, 429, "1"], [0.1, 500, None]]}
CLI = [sys.executable, "-m", "pipeline_assets.cli"]
HANG_SECONDS = 600.0


def write_corpus(root: Path, n: int, *, two_chunks_in: int = 9, of: int = 11) -> None:
    """n documents: ``two_chunks_in`` of every ``of`` carry ~600 tokens (two chunks), the rest one."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        words = 300 if i % of < two_chunks_in else 60
        body = " ".join(f"w{(i * 7 + j) % 997}" for j in range(words))
        (root / f"doc{i:04d}.md").write_text(f"# doc {i}\n\n{body}\n")


def worker_env(url: str, base_url: str) -> dict:
    return os.environ | {
        "PIPELINE_DATABASE_URL": url,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": "test-key",
        "PIPELINE_EMBEDDING_MODEL": MODEL,
        "PIPELINE_MODEL_MAX_INPUT_TOKENS": "8191",
    }  # the fake's model has no known window


def ready(url: str) -> dict:
    with db.connect(url) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall())


def run_worker(base_url: str, corpus: Path, mix: list, seed: int) -> dict:
    with fresh_database("b13") as url:
        env = worker_env(url, base_url)
        subprocess.run([*CLI, "ingest", str(corpus)], env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        post_faults(base_url, clear=True, reset_stats=True, random_faults=mix, fault_seed=seed)
        started = time.monotonic()
        proc = subprocess.run(
            [*CLI, "work", "--until-idle", "--json"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=HANG_SECONDS,
        )
        seconds = time.monotonic() - started
        stats = fetch_stats(base_url, brief=True)
        with db.connect(url) as conn:
            sizes = [r[0] for r in conn.execute("SELECT inputs FROM app.provider_calls WHERE inputs > 0")]
            # From its first request to its last answer stored: the process's start-up and its
            # vector index build at the end are not the retry policy's.
            (span,) = conn.execute("SELECT extract(epoch FROM max(e.created_at)) FROM app.embeddings e").fetchone()
        span = float(span) - min(stats["arrivals"])
        return {
            "seconds": round(span, 2),
            "process_seconds": round(seconds, 2),
            "exit": proc.returncode,
            "jobs": ready(url),
            "requests": stats["requests"],
            "by_status": stats["responses_by_status"],
            "smallest_request": min(sizes) if sizes else None,
            "error": proc.stderr.strip()[-300:] or None,
        }


def chunk_texts(base_url: str, corpus: Path) -> list[str]:
    with fresh_database("b13_texts") as url:
        subprocess.run(
            [*CLI, "ingest", str(corpus)],
            env=worker_env(url, base_url),
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with db.connect(url) as conn:
            return [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks ORDER BY 1")]


def run_baseline(base_url: str, texts: list[str], mix: list, seed: int) -> dict:
    """A plain client: each request of BATCH inputs, sent by THREADS threads, is sent again after its
    Retry-After (at once without one) until answered."""
    post_faults(base_url, clear=True, reset_stats=True, random_faults=mix, fault_seed=seed)
    client = openai.OpenAI(api_key="test-key", base_url=base_url, max_retries=0)
    batches = [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]
    lock = threading.Lock()
    done: list[int] = []
    finished = [0.0]  # time.time() of the last answer

    def send(batch: list[str]) -> None:
        deadline = time.monotonic() + HANG_SECONDS
        while time.monotonic() < deadline:
            try:
                client.embeddings.create(model=MODEL, input=batch)
                with lock:
                    done.append(len(batch))
                    finished[0] = time.time()
                return
            except openai.APIStatusError as exc:
                retry_after = exc.response.headers.get("retry-after")
                time.sleep(float(retry_after) if retry_after else 0.0)

    def loop() -> None:
        while True:
            with lock:
                if not batches:
                    return
                batch = batches.pop(0)
            send(batch)

    started = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - started
    stats = fetch_stats(base_url, brief=True)
    return {
        "seconds": round(finished[0] - min(stats["arrivals"]), 2),
        "process_seconds": round(seconds, 2),
        "embedded": sum(done),
        "requests": stats["requests"],
    }


def run_outage(base_url: str, corpus: Path, outage_seconds: float) -> dict:
    with fresh_database("b13_outage") as url:
        env = worker_env(url, base_url)
        subprocess.run([*CLI, "ingest", str(corpus)], env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        total = sum(ready(url).values())
        post_faults(base_url, clear=True, reset_stats=True, random_faults=[[1.0, 503, None]])
        proc = subprocess.Popen([*CLI, "work"], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + HANG_SECONDS
            with db.connect(url) as conn:
                while conn.execute("SELECT tripped FROM app.provider_state").fetchone() != (True,):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the breaker never tripped")
                    time.sleep(0.2)
            tripped = time.monotonic()
            time.sleep(outage_seconds)  # the outage itself: the scenario, not a wait for a result
            during = fetch_stats(base_url, brief=True)["requests"]
            recovered_wall = time.time()
            post_faults(base_url, random_faults=[])
            recovered = time.monotonic()
            first = None
            while time.monotonic() < recovered + HANG_SECONDS:
                if first is None:
                    after = [t for t in fetch_stats(base_url, brief=True)["arrivals"] if t >= recovered_wall]
                    first = min(after) - recovered_wall if after else None
                if ready(url).get("ready", 0) == total:
                    break
                time.sleep(0.1)
            complete = time.monotonic() - recovered
        finally:
            proc.terminate()
            proc.wait(30)
    return {
        "documents": total,
        "outage_seconds": round(recovered - tripped, 1),
        "requests_during_outage": during,
        "first_request_after_recovery_s": round(first, 2) if first else None,
        "complete_after_recovery_s": round(complete, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=200)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--outage-seconds", type=float, default=40.0)
    p.add_argument("--outage-documents", type=int, default=60)
    p.add_argument("--skip-outage", action="store_true")
    args = p.parse_args()
    out: dict = {
        "benchmark": "b13_provider_faults",
        "batch_inputs": BATCH,
        "concurrency": THREADS,
        "load_before": os.getloadavg(),
    }
    fake, base_url = start_fake("--dim", str(DIM))
    try:
        with tempfile.TemporaryDirectory(prefix="b13-") as tmp:
            corpus = Path(tmp) / "c"
            write_corpus(corpus, args.documents)
            texts = chunk_texts(base_url, corpus)
            out["corpus"] = {"documents": args.documents, "chunks": len(texts)}
            targets = {}
            for name, mix in MIXES.items():
                runs = [
                    {
                        "worker": run_worker(base_url, corpus, mix, seed),
                        "baseline": run_baseline(base_url, texts, mix, seed),
                    }
                    for seed in range(args.runs)
                ]
                worker = statistics.median(r["worker"]["seconds"] for r in runs)
                baseline = statistics.median(r["baseline"]["seconds"] for r in runs)
                out[name] = {
                    "mix": mix,
                    "worker_median_s": worker,
                    "baseline_median_s": baseline,
                    "ratio": round(worker / baseline, 2) if baseline else None,
                    "runs": runs,
                }
                targets[f"{name}_ratio<=2"] = bool(baseline) and worker / baseline <= 2
            if not args.skip_outage:
                outage_corpus = Path(tmp) / "outage"
                write_corpus(outage_corpus, args.outage_documents, two_chunks_in=0)
                o = out["outage"] = run_outage(base_url, outage_corpus, args.outage_seconds)
                targets["first_probe<=10s"] = (
                    o["first_request_after_recovery_s"] is not None and o["first_request_after_recovery_s"] <= 10
                )
                targets["complete<=15s"] = o["complete_after_recovery_s"] <= 15
            out["targets"] = targets
    finally:
        fake.terminate()
        fake.wait(10)
    out["load_after"] = os.getloadavg()
    emit(out)


if __name__ == "__main__":
    main()
