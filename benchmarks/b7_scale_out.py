"""B7: scale-out: jobs/s of 1, 2 and 4 worker processes on one queue.

N one-chunk documents are ingested once into a template database, their jobs held back; each
measurement copies it, starts K real `pipeline-assets work` processes, waits until all K are registered
(app.workers), releases the jobs, waits until every job is ready and stops the workers (SIGTERM). The
fake OpenAI server (process mode) answers after ``--latency`` (20 ms: at zero each process is pure CPU
and K processes measure only how the cores are shared; `--latency 0` measures that case). jobs/s =
jobs / the drain window from the spend ledger (start-up not counted; `wall_s` includes it); rounds
interleaved, the median per count. Checked every run: every job ready, every input sent exactly once.

    python benchmarks/b7_scale_out.py [--documents 8000] [--concurrency 4] [--batch-inputs 32]
                                      [--latency 0.02] [--rounds 3] [--workers 1,2,4]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from _common import REPO, emit, fresh_database, server_url, start_fake, with_dbname
from psycopg import sql

from pipeline_assets_tests.fake_openai_wire import fetch_stats

DIM = 64
CLI = [sys.executable, "-m", "pipeline_assets.cli"]  # the `pipeline-assets` entry point


def write_corpus(root: Path, n: int) -> None:
    """n distinct short documents, one chunk each."""
    for i in range(n):
        folder = root / f"{i // 1000:03d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        (folder / f"doc-{i:06d}.md").write_text(f"# Document {i}\n\nScale-out item {i}: claim, call, complete.\n")


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def one_run(template: str, processes: int, env: dict, concurrency: int, jobs_total: int) -> dict:
    """Copy the template, drain it with `processes` workers, drop the copy.

    The template's jobs are held back (available_at = infinity); the workers
    start, register (app.workers), and only then are the jobs released, so
    every process is there from the first claim, whatever its start-up time."""
    server = server_url()
    name = f"bench_b7_run_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template)))
    url = with_dbname(server, name)
    workers: list[subprocess.Popen] = []
    try:
        run_env = env | {"PIPELINE_DATABASE_URL": url}
        started = time.monotonic()
        workers = [
            subprocess.Popen(
                [*CLI, "work", "--json", "--concurrency", str(concurrency), "--worker-id", f"b7-{i}"],
                env=run_env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for i in range(processes)
        ]
        with psycopg.connect(url, autocommit=True) as conn:

            def count(query: str) -> int:
                return conn.execute(query).fetchone()[0]

            _wait(
                lambda: (
                    count("SELECT count(*) FROM app.workers") >= processes or any(w.poll() is not None for w in workers)
                ),
                120,
                "the workers to register",
            )
            released = time.monotonic()
            conn.execute("UPDATE app.embedding_jobs SET available_at = now()")
            _wait(
                lambda: (
                    count("SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'") >= jobs_total
                    or any(w.poll() is not None for w in workers)
                ),
                900,
                "the drain",
            )
            drained = time.monotonic() - released
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGTERM)
        results = [w.communicate(timeout=120) for w in workers]
        wall = time.monotonic() - started
        with psycopg.connect(url) as conn:
            jobs = dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall())
            window, requests = conn.execute(
                "SELECT extract(epoch FROM max(answered_at) - min(called_at)), count(*)"
                " FROM app.provider_calls WHERE billed = 'yes'"
            ).fetchone()
            duplicates = conn.execute("SELECT coalesce(sum(sends - 1), 0) FROM app.input_sends").fetchone()[0]
            per_worker = dict(
                conn.execute(
                    "SELECT worker_id, sum(inputs) FROM app.provider_calls WHERE billed = 'yes' GROUP BY 1 ORDER BY 1"
                ).fetchall()
            )
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait(10)
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    ready = jobs.get("ready", 0)
    return {
        "processes": processes,
        "jobs_per_s": round(ready / float(window), 1) if window else None,
        "drain_s": round(float(window or 0), 2),
        "release_to_ready_s": round(drained, 2),
        "wall_s": round(wall, 2),
        "ready": ready,
        "jobs": jobs,
        "requests": requests,
        "duplicate_sends": int(duplicates),
        "inputs_per_worker": {k: int(v) for k, v in per_worker.items()},
        "exit_codes": [w.returncode for w in workers],
        "errors": [
            err.strip().splitlines()[-1] for (_, err), w in zip(results, workers) if w.returncode != 0 and err.strip()
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=8000)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per worker process")
    p.add_argument("--batch-inputs", type=int, default=32, help="PIPELINE_BATCH_INPUTS")
    p.add_argument("--latency", type=float, default=0.02, help="the fake provider's answer time (s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", default="1,2,4", help="worker process counts to measure")
    args = p.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    out: dict = {
        "benchmark": "b7_scale_out",
        "cpus": os.cpu_count(),
        "fake": {"latency_s": args.latency, "dim": DIM},
        "workers": {"concurrency": args.concurrency, "PIPELINE_BATCH_INPUTS": args.batch_inputs},
        "documents": args.documents,
    }
    fake, base_url = start_fake("--dim", str(DIM), "--latency", str(args.latency))
    rounds: list[list[dict]] = []
    try:
        with fresh_database("b7") as template, tempfile.TemporaryDirectory(prefix="b7-") as tmp:
            write_corpus(Path(tmp), args.documents)
            env = os.environ | {
                "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": "test-key",
                "PIPELINE_EMBEDDING_MODEL": "fake-embed",
                "PIPELINE_MODEL_MAX_INPUT_TOKENS": "8191",
                "PIPELINE_BATCH_INPUTS": str(args.batch_inputs),
            }
            t = time.monotonic()
            subprocess.run(
                [*CLI, "ingest", tmp],
                env=env | {"PIPELINE_DATABASE_URL": template},
                cwd=REPO,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            out["ingest_s"] = round(time.monotonic() - t, 1)
            with psycopg.connect(template, autocommit=True) as conn:  # held back until the workers are up
                conn.execute("UPDATE app.embedding_jobs SET available_at = 'infinity'")
            for r in range(args.rounds):
                rounds.append([one_run(_dbname(template), k, env, args.concurrency, args.documents) for k in counts])
                print(
                    f"round {r + 1}: " + ", ".join(f"{x['processes']}p {x['jobs_per_s']} jobs/s" for x in rounds[-1]),
                    file=sys.stderr,
                )
        out["fake_requests"] = fetch_stats(base_url, brief=True)["requests"]
    finally:
        fake.terminate()
        fake.wait(10)
    median: dict[str, dict] = {}
    for i, k in enumerate(counts):
        runs = sorted((rnd[i] for rnd in rounds), key=lambda x: x["jobs_per_s"] or 0)
        mid = runs[len(runs) // 2]
        median[str(k)] = {
            "jobs_per_s": mid["jobs_per_s"],
            "rounds_jobs_per_s": [x["jobs_per_s"] for x in (rnd[i] for rnd in rounds)],
            "drain_s": mid["drain_s"],
            "wall_s": mid["wall_s"],
            "inputs_per_worker": mid["inputs_per_worker"],
        }
    out["result"] = median
    base = median[str(counts[0])]["jobs_per_s"]
    out["speedup"] = {k: round(v["jobs_per_s"] / base, 2) for k, v in median.items() if base and v["jobs_per_s"]}
    out["checks"] = {
        "every_job_ready": all(x["ready"] == args.documents for rnd in rounds for x in rnd),
        "no_input_sent_twice": all(x["duplicate_sends"] == 0 for rnd in rounds for x in rnd),
        "workers_exited_0": all(set(x["exit_codes"]) == {0} for rnd in rounds for x in rnd),
    }
    out["errors"] = sorted({e for rnd in rounds for x in rnd for e in x["errors"]})
    out["runs"] = rounds
    emit(out)


def _dbname(url: str) -> str:
    return psycopg.conninfo.conninfo_to_dict(url)["dbname"]


if __name__ == "__main__":
    main()
