"""B18: a bucket costs what it holds: one bucket's no-op run against the whole corpus's.

N documents (b10's generator) embedded by `embed` (offline model, not timed); then, in this process,
the runs a partition materialization makes (``sync_documents`` and the chained ``embeddings`` run,
in-process, ephemeral instance): one over every bucket, then, timed with nothing changed,
``one_bucket_s`` (median of ``--repeat``) and ``all_buckets_s``; ``ratio`` = one / all. A bucket holds
1/64 of the corpus: a run that costs what it holds is near 1/64 plus the runs' fixed cost, one that
scans the corpus near 1. Target: one bucket ≤ 10 s at 100,000 documents. ``--keep DIR`` and
``--reuse DIR`` (another checkout timed on the same data): benchmarks/README.md, B18.

    python benchmarks/b18_bucket_cost.py [--documents 10000] [--repeat 3]
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

from _common import emit, fresh_database, settle
from b10_dagster_scale import cli_bin, write_corpus

BUCKET = 5  # the bucket timed (any: the hash spreads documents evenly)
TARGET_SECONDS = 10.0  # one bucket's no-op run at 100k documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="write, embed and keep the corpus and its database here")
    parser.add_argument("--reuse", type=Path, help="time the runs on a corpus and database --keep kept")
    args = parser.parse_args()
    if args.reuse:
        corpus, url = args.reuse / "corpus", (args.reuse / "url").read_text().strip()
        measure(corpus, url, args.repeat, embed_s=None)
    elif args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        with fresh_database("bucket", keep=True) as url:
            (args.keep / "url").write_text(url)
            embed(args.keep / "corpus", url, args.documents)
    else:
        with tempfile.TemporaryDirectory(prefix="b18-") as tmp, fresh_database("bucket") as url:
            corpus = Path(tmp) / "corpus"
            measure(corpus, url, args.repeat, embed_s=embed(corpus, url, args.documents))
    sys.exit(0)


def environment(corpus: Path, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DAGSTER_"))}
    env.update(PIPELINE_DATABASE_URL=url, PIPELINE_SOURCE_DIR=str(corpus))
    env.pop("PIPELINE_EMBEDDING_MODEL", None)
    return env


def embed(corpus: Path, url: str, documents: int) -> float:
    """Write the corpus and embed it with the command line; the seconds the embed took."""
    write_corpus(corpus, documents)
    started = time.perf_counter()
    subprocess.run(
        [*cli_bin(), "embed", str(corpus)],
        env=environment(corpus, url),
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=3 * 3600,
    )
    return time.perf_counter() - started


def measure(corpus: Path, url: str, repeat: int, embed_s: float | None) -> None:
    os.environ.clear()
    os.environ.update(environment(corpus, url))
    import dagster as dg  # after the environment: the definitions read it

    from pipeline_assets.defs.definitions import build_definitions
    from pipeline_assets.defs.partitions import bucket_key
    from pipeline_assets.settings import Settings
    from pipeline_assets_tests.dagster_helpers import execute

    n = Settings.from_env().partition_buckets
    defs, instance = build_definitions(), dg.DagsterInstance.ephemeral()
    every = {
        "dagster/asset_partition_range_start": bucket_key(0),
        "dagster/asset_partition_range_end": bucket_key(n - 1),
    }

    def timed(**kw) -> float:
        settle(url)
        t = time.perf_counter()
        result = execute(defs, instance, **kw)
        assert result.success, "a no-op run failed"
        return time.perf_counter() - t

    first_s = timed(tags=every)
    one = [timed(partition_key=bucket_key(BUCKET)) for _ in range(repeat)]
    all_s = timed(tags=every)
    one_s = statistics.median(one)
    emit(
        {
            "documents": sum(1 for _ in corpus.rglob("*") if _.is_file()),
            "buckets": n,
            "setup_embed_s": None if embed_s is None else round(embed_s, 1),
            "first_all_buckets_s": round(first_s, 2),
            "one_bucket_s": round(one_s, 2),
            "one_bucket_runs_s": [round(x, 2) for x in one],
            "all_buckets_s": round(all_s, 2),
            "ratio": round(one_s / all_s, 3),
            "target_one_bucket_s": TARGET_SECONDS,
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        }
    )


if __name__ == "__main__":
    main()
