"""Ingest throughput with the ingest guards.

Writes a synthetic corpus of N documents (80% markdown of about 1.5 KB, 10% HTML, 10% text of about
12 KB, several chunks each), then times ``ingest_directory`` into a fresh database: a cold pass
(everything new) and a warm pass (nothing changed), each ``--repeat`` times; prints the best and median
docs/s, and docs per CPU second of the client (this process and its extraction child, not the
server), which other load on a shared machine disturbs less. It uses only ``ingest_directory`` and
``IngestOptions``, so a copy of an older checkout runs the same script.

    python benchmarks/ingest_guards.py [--docs 2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
from pathlib import Path

from _common import Timer, emit, fresh_database, peak_rss_mb, rate

from pipeline_assets.app.ingest import ingest_directory
from pipeline_assets.app.runtime import IngestOptions, chunker_for
from pipeline_assets.settings import Settings
from pipeline_assets.store import db


def write_corpus(root: Path, n: int) -> int:
    total = 0
    for i in range(n):
        sub = root / f"d{i % 20:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        words = " ".join(f"w{(i * 31 + j) % 5003}" for j in range(250))
        if i % 10 == 8:
            data = (
                f"<html><head><title>doc {i}</title><style>p{{}}</style></head><body><h1>doc {i}</h1>"
                + "".join(f"<p>{words[k : k + 200]}</p>" for k in range(0, len(words), 200))
                + "</body></html>"
            ).encode()
            name = f"doc{i:05d}.html"
        elif i % 10 == 9:
            data = "\n\n".join(f"para {k} of {i}: {words}" for k in range(8)).encode()
            name = f"doc{i:05d}.txt"
        else:
            data = f"# doc {i}\n\n{words}\n".encode()
            name = f"doc{i:05d}.md"
        (sub / name).write_bytes(data)
        total += len(data)
    return total


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the extraction child is
    joined at the end of each ingest): robust to other load on a shared machine."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def one_run(root: Path, options: IngestOptions) -> dict:
    with fresh_database("ingest") as url, db.connect(url) as conn:
        cpu = cpu_seconds()
        with Timer() as cold:
            first = ingest_directory(conn, root, options)
        cpu = cpu_seconds() - cpu
        with Timer() as warm:
            second = ingest_directory(conn, root, options)
        chunks = conn.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
    assert second.unchanged == first.scanned, (first, second)
    return {
        "cold_s": cold.seconds,
        "cold_cpu_s": cpu,
        "warm_s": warm.seconds,
        "scanned": first.scanned,
        "quarantined": first.quarantined,
        "chunks": chunks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    settings = Settings.from_env()
    chunker = chunker_for(settings, hard_limit=8191)
    if hasattr(settings, "ingest_config"):  # a checkout whose ingest bounds are one IngestConfig
        options = IngestOptions(chunker=chunker, config=settings.ingest_config())
    else:  # an older checkout: the bounds were IngestOptions' own fields
        options = IngestOptions(chunker=chunker, max_bytes=settings.max_input_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "corpus"
        corpus_bytes = write_corpus(root, args.docs)
        runs = [one_run(root, options) for _ in range(args.repeat)]
    cold = [rate(r["scanned"], r["cold_s"]) for r in runs]
    warm = [rate(r["scanned"], r["warm_s"]) for r in runs]
    per_cpu = [rate(r["scanned"], r["cold_cpu_s"]) for r in runs]
    emit(
        {
            "benchmark": "ingest_guards",
            "docs": args.docs,
            "corpus_bytes": corpus_bytes,
            "chunks": runs[0]["chunks"],
            "quarantined": runs[0]["quarantined"],
            "cold_docs_per_s": {"best": max(cold), "median": statistics.median(cold), "all": cold},
            "warm_docs_per_s": {"best": max(warm), "median": statistics.median(warm), "all": warm},
            "cold_docs_per_client_cpu_s": {"best": max(per_cpu), "median": statistics.median(per_cpu), "all": per_cpu},
            "peak_rss_mb": peak_rss_mb(),
        }
    )


if __name__ == "__main__":
    main()
