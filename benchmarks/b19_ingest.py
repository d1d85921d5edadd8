"""B19 (ingest alone): `pipeline-assets ingest DIR` of b3's corpus, checkouts and settings side by side.

Each round runs every variant once, alternating, each on a fresh database it migrates itself. Per run:
`first_s` and `last_s`, process start to the start of the first and of the last ingest transaction
(documents.created_at), and `wall_s` (the process, with the text-search fill and the exit). Medians.

    python benchmarks/b19_ingest.py --docs 10000 --rounds 5 old=/path/to/old new=. \
        one_child=.:PIPELINE_EXTRACT_PROCESSES=1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from _common import emit, fresh_database, settle
from b1_cli_sdk import cli_env
from b3_rerun import write_corpus

CLI = [sys.executable, "-m", "pipeline_assets.cli"]
TIMEOUT_SECONDS = 3600


def one_run(corpus: Path, checkout: str, overrides: dict[str, str]) -> dict:
    with fresh_database("ingest", migrate=False) as url:
        env = {**cli_env(url, "http://127.0.0.1:9", 256), **overrides}  # no provider call is made
        subprocess.run([*CLI, "migrate"], env=env, cwd=checkout, check=True, capture_output=True, timeout=600)
        settle(url)
        load = os.getloadavg()[0]
        started, epoch0 = time.perf_counter(), time.time()
        proc = subprocess.run(
            [*CLI, "ingest", str(corpus)],
            env=env,
            cwd=checkout,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
        )
        wall = time.perf_counter() - started
        assert proc.returncode == 0, proc.stderr[-2000:]
        with psycopg.connect(url) as conn:
            first, last = conn.execute(
                "SELECT extract(epoch FROM min(created_at)), extract(epoch FROM max(created_at)) FROM app.documents"
            ).fetchone()
    return {
        "first_s": round(float(first) - epoch0, 3),
        "last_s": round(float(last) - epoch0, 3),
        "wall_s": round(wall, 3),
        "load": round(load, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("variants", nargs="+", help="NAME=CHECKOUT[:VAR=VALUE,...]")
    a = p.parse_args()
    variants = {}
    for v in a.variants:
        name, rest = v.split("=", 1)
        checkout, _, settings = rest.partition(":")
        variants[name] = (str(Path(checkout).resolve()), dict(kv.split("=", 1) for kv in settings.split(",") if kv))
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="b19i-") as tmp:
        corpus = Path(tmp) / "corpus"
        write_corpus(corpus, a.docs)
        for _ in range(a.rounds):
            for name, (checkout, overrides) in variants.items():
                runs[name].append(one_run(corpus, checkout, overrides))
    emit(
        {
            "docs": a.docs,
            "rounds": a.rounds,
            "variants": {
                name: {
                    **{k: round(statistics.median(r[k] for r in rs), 3) for k in ("first_s", "last_s", "wall_s")},
                    "runs": rs,
                }
                for name, rs in runs.items()
            },
        }
    )


if __name__ == "__main__":
    main()
