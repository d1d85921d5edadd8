"""B12: the memory of a bucket run as the corpus grows.

Runs what a Dagster run over every bucket executes in its run worker (``sync_buckets``, then
``embed_buckets``; offline model) in a process of its own over N and FACTOR*N documents, and reports
what each adds to the peak RSS (Dagster's own processes: B10). Target: the large corpus's peak within
1.25x the small one's. ``--keys N``: only an embeddings run's calls on its current documents' keys
(``current_pks``, ``enqueue_for_docs``, ``refresh_embed_docs``; rolled back) over N one-chunk documents,
per checkout of ``--checkouts``: peak RSS before and after each call. Usage: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from _common import REPO, emit, fresh_database
from b10_dagster_scale import write_corpus

from pipeline_assets_tests.data_helpers import one_chunk_documents


def rss_mb() -> float:
    """This process's peak RSS so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(root: str) -> None:
    """In the measured process: the two use cases of a run over every bucket."""
    from pipeline_assets.app import buckets
    from pipeline_assets.app.embed_selection import embed_buckets
    from pipeline_assets.app.runtime import Runtime
    from pipeline_assets.settings import Settings
    from pipeline_assets.store import bucket_rows, db

    settings = Settings.from_env()
    rt = Runtime.build(settings)
    path = Path(root)
    with db.open_pool(settings.database_config()) as pool:
        with pool.connection() as conn:
            n = bucket_rows.fixed_bucket_count(conn, settings.partition_buckets)
        base = rss_mb()
        started = time.perf_counter()
        synced = buckets.sync_buckets(rt, pool, path, range(n), n)
        sync_s, after_sync = time.perf_counter() - started, rss_mb()
        started = time.perf_counter()
        done = embed_buckets(rt, pool, path, range(n), n)
        embed_s, after_embed = time.perf_counter() - started, rss_mb()
    print(
        json.dumps(
            {
                "base_mb": round(base, 1),
                "after_sync_mb": round(after_sync, 1),
                "after_embed_mb": round(after_embed, 1),
                "sync_seconds": round(sync_s, 1),
                "embed_seconds": round(embed_s, 1),
                "ingested": synced.changed,
                "ready": done.after.ready,
                "chunks": done.after.wanted,
            }
        )
    )


def measure(n: int, env: dict) -> dict:
    with fresh_database(f"b12_{n}") as url, tempfile.TemporaryDirectory(prefix="b12-") as tmp:
        write_corpus(Path(tmp), n)
        proc = subprocess.run(
            [sys.executable, __file__, "--child", tmp],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            env={**env, "PIPELINE_DATABASE_URL": url},
        )
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["ingested"] != n or out["ready"] != out["chunks"]:
        raise SystemExit(f"b12: the run did not bring {n} documents current and embedded: {out}")
    out["documents"] = n
    out["sync_added_mb"] = round(out["after_sync_mb"] - out["base_mb"], 1)
    out["run_added_mb"] = round(out["after_embed_mb"] - out["base_mb"], 1)
    return out


# In a checkout's own interpreter (its PYTHONPATH, not this file's tree): the run's three calls on the keys.
KEYS_CHILD = """
import json, sys, time
from pipeline_assets.jobqueue import transitions
from pipeline_assets.store import bucket_rows, db, stage_runs
def peak():  # VmHWM: this program's own (ru_maxrss keeps the forking parent's across exec)
    return round(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024, 1)
out, conn = {"base_mb": peak()}, db.connect(sys.argv[1], autocommit=False)
for name, call in (
    ("keys", lambda: bucket_rows.current_pks(conn, "/keys", range(64), 64)),
    ("enqueue", lambda: transitions.enqueue_for_docs(conn, keys, 3)),
    ("refresh", lambda: stage_runs.refresh_embed_docs(conn, "test/m@8", keys)),
):
    started = time.perf_counter()
    value = call()
    keys = value if name == "keys" else keys
    rows = len(value) if name == "keys" else value
    out[name] = {"rows": rows, "peak_mb": peak(), "s": round(time.perf_counter() - started, 1)}
conn.rollback()
print(json.dumps(out))
"""


def measure_keys(n: int, checkouts: list[Path]) -> dict:
    """The keys' calls over ``n`` documents in each checkout, on one database."""
    with fresh_database(f"b12keys_{n}") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            one_chunk_documents(conn, "/keys", n)  # and the model test/m@8
            conn.execute("VACUUM ANALYZE app.documents, app.chunks")
        out = {}
        for tree in checkouts:
            proc = subprocess.run(
                [sys.executable, "-c", KEYS_CHILD, url],
                cwd=tree,
                env={**os.environ, "PYTHONPATH": str(tree)},
                check=True,
                capture_output=True,
                text=True,
            )
            out[str(tree)] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=10_000)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--keys", type=int, help="only the embeddings run's calls on N documents' keys")
    p.add_argument("--checkouts", default=str(REPO), help="comma-separated checkouts for --keys, in turn")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    if args.keys:
        trees = [Path(c).resolve() for c in args.checkouts.split(",")]
        emit({"benchmark": "b12_run_keys", "keys": args.keys, "by_checkout": measure_keys(args.keys, trees)})
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_") and k != "PIPELINE_EMBEDDING_MODEL"}
    small, large = measure(args.documents, env), measure(args.documents * args.factor, env)
    ratio = round(large["after_embed_mb"] / small["after_embed_mb"], 2)
    emit(
        {
            "benchmark": "b12_bucket_run_memory",
            "small": small,
            "large": large,
            f"peak_rss_ratio_{args.factor}x": ratio,
            "added_kb_per_document": round(
                (large["run_added_mb"] - small["run_added_mb"]) * 1024 / (large["documents"] - small["documents"]), 2
            ),
            "targets": {"peak_flat_within_1.25x": ratio <= 1.25},
        }
    )


if __name__ == "__main__":
    main()
