"""B19: `pipeline-assets embed DIR` end to end against the composite floor, side by side.

One zero-latency OpenAI-compatible fake, N documents (b3's corpus), a fresh database per round.
floor = cl100k tokenization of the texts alone + the openai SDK alone sending the chunk texts `embed`
sends (benchmarks/_sdk_alone.py) + binary COPY of the same rows; `embed` = `pipeline-assets embed DIR
--json` as a process; `ratio` = floor / embed wall time (target >= 0.6); `ratio_with_index` adds
pgvector's HNSW build alone to the floor. The floor is measured a slice of documents at a time, so
memory is bounded whatever N. `--checkouts OLD,NEW` alternates checkouts within each round (medians
per checkout). Each part and key: benchmarks/README.md, B19.

    python benchmarks/b19_end_to_end.py [--docs 10000] [--dim 256] [--rounds 1]
    python benchmarks/b19_end_to_end.py --docs 10000 --rounds 3 --checkouts /path/to/old,.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.pool
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import psycopg
from _common import REPO, emit, fresh_database, settle, start_fake
from _sdk_alone import KEY, MODEL, sdk_alone
from b1_cli_sdk import cli_env
from b3_rerun import FOLDER_DOCUMENTS, document_path, document_text, write_corpus
from pgvector.psycopg import register_vector

from pipeline_assets.app.runtime import chunker_for
from pipeline_assets.content.chunking import get_encoding
from pipeline_assets.content.extract import extract_text
from pipeline_assets.content.sandbox import usable_cores
from pipeline_assets.jobqueue.worker_config import DEFAULT_CONCURRENCY
from pipeline_assets.registry.index_memory import build_memory
from pipeline_assets.registry.registry_config import DEFAULT_INDEX_BUILD_MEMORY
from pipeline_assets.settings import Settings

TARGET_RATIO = 0.6
CLI = [sys.executable, "-m", "pipeline_assets.cli"]
RSS_SAMPLE_SECONDS = 0.05
STARTUP_RUNS = 3
TIMEOUT_SECONDS = 3 * 3600
TOKENIZE_SLICE = 10_000
# Documents whose texts and chunk rows the floor holds at once (the corpus is measured a slice at a time).
FLOOR_SLICE_DOCS = 20_000


_settings: Settings | None = None  # of a pool process: read once


def _chunk_rows(task: tuple[int, int]) -> tuple[list[str], list[tuple]]:
    """The texts of documents ``start..stop`` and the chunk rows ingest writes for them (same
    extractor and chunker; ``pk``: the document's index, its order among the sorted paths)."""
    global _settings
    if _settings is None:
        _settings = Settings.from_env()
    chunker = chunker_for(_settings, hard_limit=8191)
    texts, rows = [], []
    for pk in range(*task):
        text = extract_text(document_path(pk), document_text(pk).encode(), decode_errors=_settings.decode_errors)
        texts.append(text)
        for c in chunker.chunk(text):
            rows.append((pk, c.index, bytes.fromhex(c.checksum), c.text, c.token_count, c.char_start, c.char_end))
    return texts, rows


def corpus_slices(pool: multiprocessing.pool.Pool, n: int) -> Iterator[tuple[list[str], list[tuple]]]:
    """The corpus's texts and chunk rows, FLOOR_SLICE_DOCS documents at a time (computed by
    ``pool``, one process per usable core): one slice is held in memory, whatever ``n``."""
    for start in range(0, n, FLOOR_SLICE_DOCS):
        stop = min(start + FLOOR_SLICE_DOCS, n)
        tasks = [(i, min(i + FOLDER_DOCUMENTS, stop)) for i in range(start, stop, FOLDER_DOCUMENTS)]
        texts: list[str] = []
        rows: list[tuple] = []
        for t, r in pool.imap(_chunk_rows, tasks):
            texts += t
            rows += r
        yield texts, rows


def tokenize_alone(texts: list[str]) -> float:
    """Seconds to tokenize every text, a slice at a time (the token lists of 1M documents would
    need ~15 GB at once)."""
    enc = get_encoding()
    started = time.perf_counter()
    for i in range(0, len(texts), TOKENIZE_SLICE):
        enc.encode_ordinary_batch(texts[i : i + TOKENIZE_SLICE], num_threads=usable_cores())
    return time.perf_counter() - started


def copy_alone(conn: psycopg.Connection, rows: list[tuple], dim: int, first_id: int) -> float:
    """Binary COPY of the chunk rows and one vector per chunk into the bare tables (``bare_tables``)."""
    rng = np.random.default_rng(first_id)
    vectors = rng.standard_normal((len(rows), dim), dtype=np.float32)
    started = time.perf_counter()
    with conn.cursor().copy("COPY bench_chunks FROM STDIN WITH (FORMAT BINARY)") as copy:
        copy.set_types(["bigint", "int4", "bytea", "text", "int4", "int4", "int4"])
        for row in rows:
            copy.write_row(row)
    with conn.cursor().copy("COPY bench_vectors (id, v) FROM STDIN WITH (FORMAT BINARY)") as copy:
        copy.set_types(["bigint", "vector"])
        for i, v in enumerate(vectors, start=first_id):
            copy.write_row((i, v))
    return time.perf_counter() - started


@contextlib.contextmanager
def bare_tables(url: str, dim: int) -> Iterator[psycopg.Connection]:
    with psycopg.connect(url, autocommit=True) as conn:
        register_vector(conn)
        conn.execute(
            "CREATE TABLE bench_chunks (doc_pk bigint, chunk_index int, chunk_checksum bytea, text text,"
            " token_count int, char_start int, char_end int)"
        )
        conn.execute(f"CREATE TABLE bench_vectors (id bigint, v vector({dim}))")
        try:
            yield conn
        finally:
            conn.execute("DROP TABLE bench_chunks, bench_vectors")


def index_alone(conn: psycopg.Connection, dim: int, vectors: int) -> float:
    """Seconds of pgvector's HNSW build over the bare vector table, with the memory the pipeline's
    build would take (``registry.index_memory.build_memory``, default cap) and the server's parallel workers."""
    session = int(
        conn.execute("SELECT setting::bigint * 1024 FROM pg_settings WHERE name = 'maintenance_work_mem'").fetchone()[0]
    )
    memory = build_memory(vectors, dim, "vector", session_memory=session, cap=DEFAULT_INDEX_BUILD_MEMORY)
    conn.execute(f"SET maintenance_work_mem = '{max(memory >> 10, 1024)}kB'")
    started = time.perf_counter()
    conn.execute("CREATE INDEX ON bench_vectors USING hnsw (v vector_cosine_ops)")
    took = time.perf_counter() - started
    conn.execute("RESET maintenance_work_mem")
    return took


def floor(
    url: str, pool: multiprocessing.pool.Pool, n: int, base_url: str, a: argparse.Namespace, threads: int, batch: int
) -> dict:
    """The composite floor, a slice of the corpus at a time (its texts and rows computed untimed):
    tokenization, the SDK alone (after an untimed pass that warms the fake's vectors, so neither
    side pays for them) and binary COPY, each summed over the slices."""
    r = {"tokenize_s": 0.0, "sdk_s": 0.0, "copy_s": 0.0, "index_s": 0.0, "chunks": 0}
    with bare_tables(url, a.dim) as conn:
        for texts, rows in corpus_slices(pool, n):
            r["tokenize_s"] += tokenize_alone(texts)
            inputs = [row[3] for row in rows]
            sdk_alone(base_url, inputs, threads=threads, batch=batch, dim=a.dim)  # warm the fake's vectors
            r["sdk_s"] += sdk_alone(base_url, inputs, threads=threads, batch=batch, dim=a.dim)
            r["copy_s"] += copy_alone(conn, rows, a.dim, r["chunks"])
            r["chunks"] += len(rows)
        r["index_s"] = index_alone(conn, a.dim, r["chunks"])
    return r


class TreeRss:
    """Peak of the summed RSS of a process and its descendants, sampled."""

    def __init__(self, pid: int) -> None:
        self.root, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                for p in [self.root, *self.root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        total += p.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, total)
            self._stop.wait(RSS_SAMPLE_SECONDS)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak / 2**20, 1)


def run_embed(corpus: Path, env: dict, checkout: Path = REPO) -> dict:
    started, epoch0 = time.perf_counter(), time.time()
    proc = subprocess.Popen(
        [*CLI, "embed", str(corpus), "--json"],
        env=env,
        cwd=checkout,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    rss = TreeRss(proc.pid)
    out, err = proc.communicate(timeout=TIMEOUT_SECONDS)
    wall = time.perf_counter() - started
    peak = rss.stop()
    assert proc.returncode == 0, err[-2000:]
    return {
        "wall_s": round(wall, 3),
        "peak_rss_mb": peak,
        "summary": json.loads(out),
        "epoch0": epoch0,
        "epoch1": epoch0 + wall,
    }


def startup(env: dict, checkout: Path = REPO) -> float:
    """Median seconds of `work --until-idle` on an empty queue: start-up to the first claim, and exit."""
    runs = []
    for _ in range(STARTUP_RUNS):
        started = time.perf_counter()
        subprocess.run(
            [*CLI, "work", "--until-idle"], env=env, cwd=checkout, check=True, capture_output=True, timeout=600
        )
        runs.append(time.perf_counter() - started)
    return round(statistics.median(runs), 3)


MEDIANS = (
    "tokenize_s",
    "sdk_s",
    "copy_s",
    "index_s",
    "floor_s",
    "embed_s",
    "embed_before_first_send_s",
    "embed_working_s",
    "embed_after_last_answer_s",
    "peak_rss_mb",
    "ratio",
    "ratio_with_index",
)


def one_round(
    corpus: Path,
    checkout: Path,
    pool: multiprocessing.pool.Pool,
    base_url: str,
    a: argparse.Namespace,
    threads: int,
    batch: int,
    first: bool,
) -> dict:
    """The floor and `embed` on a fresh database the checkout migrates itself."""
    with fresh_database("e2e", migrate=False) as url:
        env = cli_env(url, base_url, a.dim)
        subprocess.run([*CLI, "migrate"], env=env, cwd=checkout, check=True, capture_output=True, timeout=600)
        settle(url)
        r: dict = {"checkout": str(checkout), **floor(url, pool, a.docs, base_url, a, threads, batch)}
        r["floor_s"] = r["tokenize_s"] + r["sdk_s"] + r["copy_s"]
        settle(url)
        r["load_before"] = os.getloadavg()
        embed = run_embed(corpus, env, checkout)
        with psycopg.connect(url) as conn:
            ready, first_call, last = conn.execute("""
                SELECT (SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'),
                       extract(epoch FROM min(called_at)), extract(epoch FROM max(answered_at))
                FROM app.provider_calls""").fetchone()
            # Search needs every chunk's text-search vector: `embed` leaves none without it.
            unsearchable = conn.execute("SELECT count(*) FROM app.chunks WHERE text_search IS NULL").fetchone()[0]
        assert ready == r["chunks"], (ready, r["chunks"])
        assert unsearchable == 0, unsearchable
        # Where embed's time went: start-up and ingest (to the first send), sending, then the
        # bulk index build, the summary and the exit (after the last answer).
        r.update(
            embed_before_first_send_s=float(first_call) - embed["epoch0"],
            embed_working_s=float(last - first_call),
            embed_after_last_answer_s=embed["epoch1"] - float(last),
        )
        r.update(
            embed_s=embed["wall_s"],
            peak_rss_mb=embed["peak_rss_mb"],
            ratio=r["floor_s"] / embed["wall_s"],
            ratio_with_index=(r["floor_s"] + r["index_s"]) / embed["wall_s"],
            load_average=os.getloadavg(),
        )
        if first:
            r["startup_empty_queue_s"] = startup(env, checkout)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1, help="rounds of floor + embed (fresh database each); medians")
    p.add_argument(
        "--checkouts",
        default=str(REPO),
        help="comma-separated checkouts whose CLI runs `embed`, alternating within each round",
    )
    a = p.parse_args()
    checkouts = [Path(c).resolve() for c in a.checkouts.split(",")]
    settings = Settings.from_env()
    threads, batch = DEFAULT_CONCURRENCY, settings.provider_config().request_inputs
    fake, base_url = start_fake("--dim", str(a.dim), "--api-key", KEY)
    rounds: dict[Path, list[dict]] = {c: [] for c in checkouts}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="b19-") as tmp,
            multiprocessing.get_context("fork").Pool(usable_cores()) as pool,
        ):
            corpus = Path(tmp) / "corpus"
            started = time.perf_counter()
            write_corpus(corpus, a.docs)
            corpus_s = round(time.perf_counter() - started, 1)
            for i in range(a.rounds):
                for checkout in checkouts:
                    rounds[checkout].append(
                        one_round(corpus, checkout, pool, base_url, a, threads, batch, first=i == 0)
                    )
    finally:
        fake.terminate()
        fake.wait(10)
    results = []
    for checkout, runs in rounds.items():
        med = {k: round(statistics.median(r[k] for r in runs), 3) for k in MEDIANS}
        results.append(
            {
                "checkout": str(checkout),
                **med,
                "startup_empty_queue_s": runs[0]["startup_empty_queue_s"],
                "embed_chunks_per_s": round(runs[0]["chunks"] / med["embed_s"], 1),
                "targets": {f"ratio_ge_{TARGET_RATIO}": med["ratio"] >= TARGET_RATIO},
                "rounds_raw": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in runs],
            }
        )
    head = {
        "docs": a.docs,
        "chunks": rounds[checkouts[0]][0]["chunks"],
        "corpus_written_s": corpus_s,
        "dim": a.dim,
        "threads": threads,
        "batch": batch,
        "model": MODEL,
        "rounds": a.rounds,
    }
    emit({**head, **results[0]} if len(results) == 1 else {**head, "checkouts": results})


if __name__ == "__main__":
    main()
