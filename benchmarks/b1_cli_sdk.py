"""B1 (CLI): `pipeline-assets work --until-idle` against the openai SDK alone, side by side.

One run, one fake provider process (benchmarks' zero-latency OpenAI-compatible
server: `python -m pipeline_assets_tests.fake_openai`), the same texts:
  (a) the openai SDK alone (max_retries=0), the worker's default threads and
      batch, sending every text once                          -> inputs/s (the ceiling)
  (b) `pipeline-assets work --until-idle` (a real process) over the same texts,
      ingested beforehand                                     -> jobs/s
(b) is reported twice: while working (first send to last answer, from the
spend ledger app.provider_calls: what the worker itself sustains) and end to end
(process start to exit: also the CLI's imports, the pool, the index build).
The fake's vectors are warmed by an untimed SDK pass first, so neither side
pays for computing them.

    python benchmarks/b1_cli_sdk.py [--docs 10000] [--dim 256] [--rounds 1] [--profile out.txt]

--profile runs (b) once more under py-spy (pip install py-spy) and writes its
top functions (`py-spy record --format raw`, folded stacks) to the file.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import psycopg
from _common import REPO, emit, fresh_database, rate

from pipeline_assets.settings import DEFAULT_CONCURRENCY, Settings

MODEL = "bench-embed"
KEY = "bench-key"  # the fake's key (a local stand-in, never a real credential)


def start_fake(dim: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "pipeline_assets_tests.fake_openai", "--port", "0", "--dim",
                             str(dim), "--api-key", KEY], cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line.startswith("READY "), line
    return proc, line.split(" ", 1)[1]


def write_corpus(root: Path, n: int) -> list[str]:
    texts = []
    for i in range(n):
        folder = root / f"{i // 1000:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        text = f"Document {i}. A short note about retries, leases and idempotent embedding jobs."
        (folder / f"d{i:06d}.txt").write_text(text + "\n")
        texts.append(text)
    return texts


def sdk_alone(base_url: str, texts: list[str], *, threads: int, batch: int, dim: int) -> float:
    """Seconds for the SDK alone to send every text once, ``threads`` threads, ``batch`` per request."""
    work: queue.Queue = queue.Queue()
    for i in range(0, len(texts), batch):
        work.put(texts[i:i + batch])
    client = openai.OpenAI(api_key=KEY, base_url=base_url, max_retries=0, timeout=30)
    got = [0] * threads

    def loop(k: int) -> None:
        while True:
            try:
                chunk = work.get_nowait()
            except queue.Empty:
                return
            resp = client.embeddings.create(model=MODEL, input=chunk, dimensions=dim)
            got[k] += len(resp.data)

    started = time.perf_counter()
    pool = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - started
    assert sum(got) == len(texts), (sum(got), len(texts))
    client.close()
    return seconds


def cli_env(url: str, base_url: str, dim: int) -> dict:
    return {**os.environ, "PIPELINE_DATABASE_URL": url, "OPENAI_API_KEY": KEY, "OPENAI_BASE_URL": base_url,
            "PIPELINE_EMBEDDING_MODEL": MODEL, "PIPELINE_EMBEDDING_DIMENSIONS": str(dim)}


def cli_work(url: str, env: dict, n: int, profile: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "pipeline_assets.cli", "work", "--until-idle", "--json"]
    if profile is not None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        cmd = [spy, "record", "--format", "raw", "--rate", "200", "--subprocesses",
               "-o", str(profile), "--"] + cmd
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE app.embedding_jobs SET status = 'pending', attempts = 0, faults = 0, available_at = now()")
        conn.execute("TRUNCATE app.embeddings, app.provider_calls, app.input_sends")
        conn.execute("VACUUM ANALYZE app.embedding_jobs")
    started, epoch0 = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    wall, epoch1 = time.perf_counter() - started, time.time()
    assert proc.returncode == 0, proc.stderr[-2000:]
    with psycopg.connect(url) as conn:
        ready, first, last = conn.execute("""
            SELECT (SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'),
                   extract(epoch FROM min(called_at)), extract(epoch FROM max(answered_at))
            FROM app.provider_calls""").fetchone()
    assert ready == n, (ready, n, proc.stderr[-2000:])
    # Before the first send: the interpreter, the CLI's imports, the pool, the model; after the last
    # answer: the drain's bulk HNSW index build (work --until-idle waits for it) and the exit.
    return {"wall_s": round(wall, 3), "working_s": round(float(last - first), 3),
            "before_first_send_s": round(float(first) - epoch0, 3),
            "after_last_answer_s": round(epoch1 - float(last), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of (a) and (b); medians reported")
    p.add_argument("--profile", type=Path, help="also profile one CLI run with py-spy (folded stacks)")
    a = p.parse_args()
    settings = Settings.from_env()
    threads, batch = DEFAULT_CONCURRENCY, settings.request_inputs
    fake, base_url = start_fake(a.dim)
    try:
        with fresh_database("clisdk") as url, tempfile.TemporaryDirectory(prefix="b1cli-") as tmp:
            texts = write_corpus(Path(tmp), a.docs)
            env = cli_env(url, base_url, a.dim)
            subprocess.run([sys.executable, "-m", "pipeline_assets.cli", "ingest", tmp], env=env, cwd=REPO,
                           check=True, capture_output=True, timeout=600)
            sdk_alone(base_url, texts, threads=threads, batch=batch, dim=a.dim)  # warm the fake's vectors
            sdk, cli = [], []
            for _ in range(a.rounds):
                sdk.append(sdk_alone(base_url, texts, threads=threads, batch=batch, dim=a.dim))
                cli.append(cli_work(url, env, a.docs))
            if a.profile is not None:
                cli_work(url, env, a.docs, profile=a.profile)
    finally:
        fake.terminate()
        fake.wait(10)
    sdk_s = statistics.median(sdk)
    working_s = statistics.median(r["working_s"] for r in cli)
    wall_s = statistics.median(r["wall_s"] for r in cli)
    emit({"docs": a.docs, "dim": a.dim, "threads": threads, "batch": batch, "rounds": a.rounds,
          "sdk_alone_inputs_per_s": rate(a.docs, sdk_s),
          "cli_jobs_per_s_working": rate(a.docs, working_s), "cli_jobs_per_s_end_to_end": rate(a.docs, wall_s),
          "ratio_working": round(sdk_s / working_s, 3), "ratio_end_to_end": round(sdk_s / wall_s, 3),
          "rounds_raw": {"sdk_s": [round(s, 3) for s in sdk], "cli": cli}})


if __name__ == "__main__":
    main()
