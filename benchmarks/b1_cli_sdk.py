"""B1 (CLI): `pipeline-assets work --until-idle` against the openai SDK alone, side by side.

One zero-latency fake provider process (`python -m pipeline_assets_tests.fake_openai`), the same texts,
interleaved rounds each starting with no vector and no index: (a) the openai SDK alone with the
worker's threads and batch (the ceiling, inputs/s); (b) `pipeline-assets work --until-idle` over the
same texts, ingested beforehand, timed while working, to the last answer and end to end; (c) the SDK
alone as a process of its own. The fake's vectors are warmed by an untimed pass first. --profile runs
(b) once more under py-spy and writes folded stacks. Each ratio and key: benchmarks/README.md,
"B1 CLI against the SDK".

    python benchmarks/b1_cli_sdk.py [--docs 10000] [--dim 256] [--rounds 3] [--profile out.txt]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from _common import REPO, emit, fresh_database, rate, start_fake
from _sdk_alone import KEY, MODEL, sdk_alone
from psycopg import sql

from pipeline_assets.jobqueue.worker_config import DEFAULT_CONCURRENCY
from pipeline_assets.settings import Settings

# The target: the worker through the CLI at least this share of the SDK alone.
TARGET_RATIO = 0.6
ROUNDS = 3  # interleaved rounds of (a), (c) and (b); medians reported


def write_corpus(root: Path, n: int) -> list[str]:
    texts = []
    for i in range(n):
        folder = root / f"{i // 1000:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        text = f"Document {i}. A short note about retries, leases and idempotent embedding jobs."
        (folder / f"d{i:06d}.txt").write_text(text + "\n")
        texts.append(text)
    return texts


def sdk_process(base_url: str, texts_file: Path, *, threads: int, batch: int, dim: int) -> float:
    """Wall seconds of (c): this script as a child (``--sdk-child``) that imports openai and sends every text."""
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("_sdk_alone.py")),
        str(texts_file),
        base_url,
        str(threads),
        str(batch),
        str(dim),
    ]
    started = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, timeout=600)
    return time.perf_counter() - started


def drop_vector_indexes(conn: psycopg.Connection) -> None:
    """Each round builds the index again (a kept index would be maintained per insert instead)."""
    names = conn.execute(
        "SELECT indexname FROM pg_indexes WHERE schemaname = 'app' AND indexname LIKE 'embeddings_hnsw_%'"
    ).fetchall()
    for (name,) in names:
        conn.execute(sql.SQL("DROP INDEX app.{}").format(sql.Identifier(name)))


def cli_env(url: str, base_url: str, dim: int) -> dict:
    return {
        **os.environ,
        "PIPELINE_DATABASE_URL": url,
        "OPENAI_API_KEY": KEY,
        "OPENAI_BASE_URL": base_url,
        "PIPELINE_EMBEDDING_MODEL": MODEL,
        "PIPELINE_EMBEDDING_DIMENSIONS": str(dim),
        "PIPELINE_MODEL_MAX_INPUT_TOKENS": "8191",
    }  # the fake server's model: no window of its own


def cli_work(url: str, env: dict, n: int, profile: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "pipeline_assets.cli", "work", "--until-idle", "--json"]
    if profile is not None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        cmd = [
            spy,
            "record",
            "--format",
            "raw",
            "--rate",
            "200",
            "--subprocesses",
            "--idle",
            "-o",
            str(profile),
            "--",
            *cmd,
        ]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE app.embedding_jobs SET status = 'pending', attempts = 0, faults = 0, available_at = now()")
        conn.execute("TRUNCATE app.embeddings, app.provider_calls, app.input_sends_until_032")
        drop_vector_indexes(conn)
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
    return {
        "wall_s": round(wall, 3),
        "working_s": round(float(last - first), 3),
        "to_last_answer_s": round(float(last) - epoch0, 3),
        "before_first_send_s": round(float(first) - epoch0, 3),
        "after_last_answer_s": round(epoch1 - float(last), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds of (a), (c), (b); medians")
    p.add_argument("--profile", type=Path, help="also profile one CLI run with py-spy (folded stacks)")
    a = p.parse_args()
    settings = Settings.from_env()
    threads, batch = DEFAULT_CONCURRENCY, settings.provider_config().request_inputs
    fake, base_url = start_fake("--dim", str(a.dim), "--api-key", KEY)
    try:
        with fresh_database("clisdk") as url, tempfile.TemporaryDirectory(prefix="b1cli-") as tmp:
            texts = write_corpus(Path(tmp) / "corpus", a.docs)
            texts_file = Path(tmp) / "texts.txt"
            texts_file.write_text("\n".join(texts))
            env = cli_env(url, base_url, a.dim)
            subprocess.run(
                [sys.executable, "-m", "pipeline_assets.cli", "ingest", str(Path(tmp) / "corpus")],
                env=env,
                cwd=REPO,
                check=True,
                capture_output=True,
                timeout=600,
            )
            sdk_alone(base_url, texts, threads=threads, batch=batch, dim=a.dim)  # warm the fake's vectors
            sdk, sdk_proc, cli = [], [], []
            for _ in range(a.rounds):
                sdk.append(sdk_alone(base_url, texts, threads=threads, batch=batch, dim=a.dim))
                sdk_proc.append(sdk_process(base_url, texts_file, threads=threads, batch=batch, dim=a.dim))
                cli.append(cli_work(url, env, a.docs))
            if a.profile is not None:
                cli_work(url, env, a.docs, profile=a.profile)
    finally:
        fake.terminate()
        fake.wait(10)
    sdk_s, sdk_proc_s = statistics.median(sdk), statistics.median(sdk_proc)
    med = {k: statistics.median(r[k] for r in cli) for k in cli[0]}
    ratios = {
        "working": round(sdk_s / med["working_s"], 3),
        "to_last_answer_vs_sdk_process": round(sdk_proc_s / med["to_last_answer_s"], 3),
        "end_to_end_vs_sdk_process": round(sdk_proc_s / med["wall_s"], 3),
        "end_to_end": round(sdk_s / med["wall_s"], 3),
    }
    emit(
        {
            "docs": a.docs,
            "dim": a.dim,
            "threads": threads,
            "batch": batch,
            "rounds": a.rounds,
            "load_average": os.getloadavg(),
            "sdk_alone_inputs_per_s": rate(a.docs, sdk_s),
            "sdk_process_s": round(sdk_proc_s, 3),
            "cli_jobs_per_s_working": rate(a.docs, med["working_s"]),
            "cli_jobs_per_s_end_to_end": rate(a.docs, med["wall_s"]),
            "cli_median_s": med,
            "ratio_working": ratios["working"],
            "ratio_end_to_end": ratios["end_to_end"],
            "ratios": ratios,
            "targets": {f"{k}_ge_{TARGET_RATIO}": v >= TARGET_RATIO for k, v in ratios.items()},
            "rounds_raw": {
                "sdk_s": [round(s, 3) for s in sdk],
                "sdk_process_s": [round(s, 3) for s in sdk_proc],
                "cli": cli,
            },
        }
    )


if __name__ == "__main__":
    main()
