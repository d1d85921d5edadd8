"""B1 A/B: the worker phase of B1 on two trees, interleaved, in one run.

Tree A is ``--rev`` extracted with ``git archive <rev> | tar -x``, tree B this checkout. Each round runs
one subprocess per tree (its ``sys.path`` that tree only: its own worker, migrations and
ZeroLatencyProvider), which ingests N one-chunk documents into a fresh database and times only the
worker draining them (concurrency 4, 100 inputs per batch, no index build), as B1 does; a VACUUM
ANALYZE before the drain (unless --no-vacuum) keeps the maintenance the ingest triggered out of it.
The order of the trees alternates between rounds. Prints JSON: every round's jobs/s, the medians,
B / A, and each tree's median CPU per job. Every flag: benchmarks/README.md, B1 A/B.

    python benchmarks/b1_ab.py [--rev 50bb427] [--jobs 20000] [--rounds 3] [--dim 256] [--timing]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# The worker configuration of B1's worker phase (benchmarks/b1_core.py bench_worker).
CONCURRENCY, BATCH_INPUTS, POLL_SECONDS = 4, 100, 0.05

# A child that takes longer than this (ingest + drain) is reported as failed.
CHILD_TIMEOUT_SECONDS = 900


def extract(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (files only, no .git) under ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_child(tree: Path, *, jobs: int, dim: int, url: str, timing: bool, vacuum: bool) -> dict:
    cmd = [sys.executable, str(HERE / "b1_ab.py"), "--child", str(tree), "--jobs", str(jobs), "--dim", str(dim)]
    cmd += ["--timing"] if timing else []
    cmd += [] if vacuum else ["--no-vacuum"]
    env = dict(os.environ, PIPELINE_DATABASE_URL=url, PYTHONPATH="")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tree), timeout=CHILD_TIMEOUT_SECONDS)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the child: one tree, one fresh database, one timed drain -------------------------------
def server_cpu_seconds(conn) -> float | None:
    """CPU seconds used so far by the database server on this machine: its
    processes and the backends that exited (the postmaster's children's time).
    Less sensitive than wall time to other load on a shared machine. None when
    the server is not local or not readable."""
    try:
        data = conn.execute("SHOW data_directory").fetchone()[0]
        postmaster = int((Path(data) / "postmaster.pid").read_text().split()[0])
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid, ppid = int(stat.parent.name), int(fields[1])
            if pid == postmaster:
                total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
            elif ppid == postmaster:
                total += int(fields[11]) + int(fields[12])
        return total / tick
    except (psycopg.Error, OSError, ValueError, IndexError):
        return None


def child(tree: Path, jobs: int, dim: int, timing: bool, vacuum: bool) -> None:
    # Only this tree: its package, its benchmarks (b1_core and its _common).
    sys.path[:] = [str(tree), str(tree / "benchmarks")] + [p for p in sys.path if p and Path(p).resolve() != HERE]
    import logging

    import b1_core  # this tree's
    from _common import fresh_database

    from pipeline_assets.jobqueue.worker import Worker, WorkerConfig
    from pipeline_assets.registry import models
    from pipeline_assets.settings import Settings
    from pipeline_assets.store import db

    logging.basicConfig(level=logging.WARNING)
    import pipeline_assets

    assert Path(pipeline_assets.__file__).resolve().is_relative_to(tree.resolve()), pipeline_assets.__file__
    provider = b1_core.ZeroLatencyProvider(dim)
    calls = wrap_store_methods() if timing else None
    with fresh_database("ab") as url, tempfile.TemporaryDirectory(prefix="b1ab-") as tmp:
        b1_core.write_corpus(Path(tmp), jobs, "ab")
        with db.connect(url) as conn:
            models.ensure_model(conn, provider.spec)
            ingest = b1_core.bench_ingest(conn, Path(tmp), jobs)
            if vacuum:  # the maintenance the ingest left (autovacuum, a GIN pending list) is the ingest's
                conn.execute("VACUUM ANALYZE")
            wal0 = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
            server0 = server_cpu_seconds(conn)
        options = {
            "concurrency": CONCURRENCY,
            "until_idle": True,
            "batch_inputs": BATCH_INPUTS,
            "poll_seconds": POLL_SECONDS,
            "build_index": False,
        }
        settings = Settings.from_env()
        if hasattr(settings, "worker_config"):  # a tree whose worker takes its own config
            worker = Worker(url, provider, settings.worker_config(**options))
        else:  # an older tree: a WorkerConfig beside the whole Settings
            worker = Worker(url, provider, WorkerConfig(**options), settings=settings)
        started, cpu = time.perf_counter(), time.process_time()
        report = worker.run()
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        with db.connect(url) as conn:
            wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (str(wal0),)).fetchone()[0]
            ready = conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0]
            server1 = server_cpu_seconds(conn)
    assert report.embedded == jobs and ready == jobs, (report.as_dict(), ready)
    out = {
        "jobs": jobs,
        "seconds": round(seconds, 3),
        "jobs_per_s": round(jobs / seconds, 1),
        "client_cpu_s": round(cpu, 3),
        "server_cpu_s": round(server1 - server0, 3) if server0 is not None and server1 is not None else None,
        "provider_calls": report.provider_calls,
        "wal_bytes_per_job": round(float(wal) / jobs),
        "ingest_chunks_per_s": ingest["chunks_per_s"],
    }
    if calls is not None:
        out["store_seconds"] = {k: [n, round(s, 3)] for k, (n, s) in sorted(calls.items())}
    print(json.dumps(out), flush=True)


def wrap_store_methods() -> dict:
    """Count calls and wall seconds of every public JobStore method (summed over threads)."""
    import threading

    from pipeline_assets.jobqueue.pg_job_store import PostgresJobStore

    totals: dict[str, list] = {}
    lock = threading.Lock()

    def wrap(name, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    entry = totals.setdefault(name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t

        return timed

    for name, fn in list(vars(PostgresJobStore).items()):
        if callable(fn) and not name.startswith("_"):
            setattr(PostgresJobStore, name, wrap(name, fn))
    return totals


# -- the parent ---------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="50bb427", help="baseline revision (tree A)")
    p.add_argument("--jobs", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--timing", action="store_true", help="time each JobStore method (summed over threads)")
    p.add_argument(
        "--also",
        type=Path,
        action="append",
        default=[],
        help="another tree to measure in the same rounds (C, D, ...), e.g. a variant under test",
    )
    p.add_argument(
        "--no-vacuum",
        action="store_true",
        help="time the drain right after the ingest, with whatever autovacuum it triggered",
    )
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.jobs, args.dim, args.timing, not args.no_vacuum)
        return

    sys.path.insert(0, str(HERE))
    from _common import server_url

    url = server_url()
    rev = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", args.rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
    )
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="b1ab-trees-") as tmp:
        trees = {"A": extract(args.rev, Path(tmp) / "a"), "B": REPO}
        trees.update({chr(ord("C") + i): path.resolve() for i, path in enumerate(args.also)})
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            result = {}
            for side in order:
                result[side] = run_child(
                    trees[side], jobs=args.jobs, dim=args.dim, url=url, timing=args.timing, vacuum=not args.no_vacuum
                )
            rounds.append(result)
            print(
                json.dumps({"round": r + 1, **{s: result[s].get("jobs_per_s", result[s]) for s in trees}}),
                file=sys.stderr,
                flush=True,
            )

    def median(side: str) -> float | None:
        rates = [x[side]["jobs_per_s"] for x in rounds if "jobs_per_s" in x[side]]
        return statistics.median(rates) if rates else None

    def cpu_per_job(side: str) -> float | None:
        """Median client + server CPU microseconds per job: steadier than jobs/s on a shared machine."""
        used = [
            (x[side]["client_cpu_s"] + x[side]["server_cpu_s"]) / x[side]["jobs"] * 1e6
            for x in rounds
            if x[side].get("server_cpu_s") is not None
        ]
        return round(statistics.median(used), 1) if used else None

    a, b = median("A"), median("B")
    print(
        json.dumps(
            {
                "benchmark": "b1_ab",
                "jobs": args.jobs,
                "dim": args.dim,
                "worker": f"concurrency={CONCURRENCY} batch_inputs={BATCH_INPUTS} poll_seconds={POLL_SECONDS}",
                "vacuum_after_ingest": not args.no_vacuum,
                "A": f"{rev} (git archive)",
                "B": f"{head}{' + uncommitted changes' if dirty else ''} (this checkout)",
                "rounds": rounds,
                "A_jobs_per_s": [x["A"].get("jobs_per_s") for x in rounds],
                "B_jobs_per_s": [x["B"].get("jobs_per_s") for x in rounds],
                "A_median": a,
                "B_median": b,
                "ratio_B_to_A": round(b / a, 3) if a and b else None,
                "cpu_us_per_job": {side: cpu_per_job(side) for side in trees},
                **(
                    {
                        "also": {
                            side: {
                                "tree": str(trees[side]),
                                "median": median(side),
                                "ratio_to_A": round(median(side) / a, 3) if a and median(side) else None,
                            }
                            for side in trees
                            if side not in "AB"
                        }
                    }
                    if args.also
                    else {}
                ),
                "within_10_percent": bool(a and b and b >= 0.9 * a),
            },
            indent=2,
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
