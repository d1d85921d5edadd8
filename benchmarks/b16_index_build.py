"""B16: the vector index build at scale, and its memory estimate.

Loads N random unit vectors of D dimensions straight into app.embeddings (binary COPY, no provider),
then builds the model's HNSW index as a worker's drain does (``vector_index.build``) and prints the
build's time, the memory it was given, the graph estimate, the peak PSS of the builder and its
parallel workers, the index size on disk and whether the graph fitted in memory. ``--calibrate``
instead checks the estimate's bytes per vector against pgvector's own accounting at several
dimensions. How each is measured: benchmarks/README.md, B16.

    python benchmarks/b16_index_build.py [--vectors 1000000] [--dim 256]
    python benchmarks/b16_index_build.py --calibrate
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import re
import threading
import time

import numpy as np
import psutil
from _common import emit, fresh_database, settle
from psycopg import sql

from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import index_memory, models, vector_index
from pipeline_assets.settings import Settings
from pipeline_assets.store import db

COPY_ROWS = 10_000  # rows generated per numpy batch
SAMPLE_SECONDS = 0.5  # memory sampling interval of the build's processes
CALIBRATION_MEMORY_MB = 4  # a serial build with this little memory spills early: its notice says when
FITS_NOTICE = re.compile(r"no longer fits into maintenance_work_mem after (\d+) tuples")


def load(url: str, dim: int, n: int, name: str = "bench") -> str:
    spec = ModelSpec(
        provider="bench", name=name, dimension=dim, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
    )
    rng = np.random.default_rng(0)
    with db.connect(url) as conn:
        models.ensure_model(conn, spec)
        with conn.cursor().copy(
            "COPY app.embeddings (chunk_checksum, model_id, embedding) FROM STDIN WITH (FORMAT BINARY)"
        ) as cp:
            cp.set_types(["bytea", "text", "vector"])
            for start in range(0, n, COPY_ROWS):
                block = rng.standard_normal((min(COPY_ROWS, n - start), dim)).astype(np.float32)
                block /= np.linalg.norm(block, axis=1, keepdims=True)
                for i, v in enumerate(block):
                    cp.write_row((hashlib.sha256(str(start + i).encode()).digest(), spec.model_id, v))
        conn.execute("ANALYZE app.embeddings")
    return spec.model_id


class BuildMemory:
    """Peak summed PSS of a backend and its parallel workers, sampled in a thread."""

    def __init__(self, url: str, pid: int) -> None:
        self.pid, self.peak, self.workers = pid, 0, 0
        self._conn = db.connect(url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BuildMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            pids = [self.pid] + [
                r[0]
                for r in self._conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE leader_pid = %s AND pid <> %s", (self.pid, self.pid)
                )
            ]
            self.workers = max(self.workers, len(pids) - 1)
            total = 0
            for pid in pids:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    total += psutil.Process(pid).memory_full_info().pss
            self.peak = max(self.peak, total)


def measure(vectors: int, dim: int, cap: int) -> dict:
    with fresh_database("index") as url:
        started = time.perf_counter()
        model_id = load(url, dim, vectors)
        loaded = time.perf_counter() - started
        settle(url)
        notices: list[str] = []
        with db.connect(url) as conn:
            conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            _, session_memory = conn.execute(models.MODELS.index_build_inputs, {"model": model_id}).fetchone()
            kind = vector_index.index_kind(dim) or "vector"
            memory = index_memory.build_memory(vectors, dim, kind, session_memory=int(session_memory), cap=cap)
            load_before = psutil.getloadavg()
            with BuildMemory(url, conn.info.backend_pid) as sampled:
                t0 = time.perf_counter()
                state = vector_index.build(conn, model_id, dim, memory_cap=cap)
                seconds = time.perf_counter() - t0
            name = vector_index.index_name(model_id)
            size = conn.execute(
                "SELECT pg_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n"
                " ON n.oid = c.relnamespace WHERE n.nspname = 'app' AND c.relname = %s",
                (name,),
            ).fetchone()[0]
        spilled = [int(m.group(1)) for m in map(FITS_NOTICE.search, notices) if m]
        estimate = index_memory.graph_bytes(vectors, dim, kind)
        return {
            "vectors": vectors,
            "dim": dim,
            "state": state,
            "load_seconds": round(loaded, 1),
            "build_seconds": round(seconds, 1),
            "vectors_per_second": round(vectors / seconds),
            "maintenance_work_mem_mb": memory >> 20,
            "graph_estimate_mb": estimate >> 20,
            "graph_fitted_in_memory": not spilled,
            "spilled_after_tuples": spilled[0] if spilled else None,
            "peak_pss_builder_and_workers_mb": sampled.peak >> 20,
            "parallel_workers": sampled.workers,
            "index_size_on_disk_mb": size >> 20,
            "estimate_over_disk_size": round(estimate / size, 2),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in psutil.getloadavg()],
        }


def calibrate() -> dict:
    out = []
    for dim, n in ((8, 40_000), (256, 12_000), (1536, 3_000), (2100, 3_000)):
        kind = vector_index.index_kind(dim) or "vector"
        with fresh_database("calib") as url:
            model_id = load(url, dim, n, name=f"c{dim}")
            notices: list[str] = []
            with db.connect(url) as conn:
                conn.add_notice_handler(lambda d, seen=notices: seen.append(d.message_primary or ""))
                conn.execute("SET max_parallel_maintenance_workers = 0")
                conn.execute(f"SET maintenance_work_mem = '{CALIBRATION_MEMORY_MB}MB'")
                conn.execute(
                    sql.SQL(models.MODELS.create_hnsw_index).format(
                        name=sql.Identifier("calib"),
                        kind=sql.Identifier(kind),
                        opclass=sql.Identifier(f"{kind}_cosine_ops"),
                        dim=sql.Literal(dim),
                        model=sql.Literal(model_id),
                    )
                )
        [tuples] = [int(m.group(1)) for m in map(FITS_NOTICE.search, notices) if m]
        measured = CALIBRATION_MEMORY_MB * 2**20 / tuples
        formula = index_memory.GRAPH_BYTES_PER_VECTOR + index_memory.VALUE_BYTES_PER_DIMENSION[kind] * dim
        out.append(
            {
                "dim": dim,
                "kind": kind,
                "measured_bytes_per_vector": round(measured),
                "formula_without_margin": formula,
                "formula_over_measured": round(formula / measured, 3),
            }
        )
    return {"calibration": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vectors", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument(
        "--cap-mb",
        type=int,
        default=Settings.from_env().index_build_memory >> 20,
        help="PIPELINE_INDEX_BUILD_MEMORY in MiB (default: the setting's)",
    )
    parser.add_argument("--calibrate", action="store_true")
    args = parser.parse_args()
    emit(calibrate() if args.calibrate else measure(args.vectors, args.dim, args.cap_mb << 20))


if __name__ == "__main__":
    main()
