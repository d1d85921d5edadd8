"""B6: `export` memory stays flat as the index grows 10x.

Loads N (then, in a fresh database, 10*N) current chunks with ready jobs and
`--dim`-dimension vectors straight into the schema (INSERT ... SELECT
generate_series, as B4 does), then runs the real CLI's `export --model` with
its output sent to /dev/null and reports the process's peak RSS. For contrast
it runs the read that `export` did before (a client-side cursor under
autocommit: the whole result lands in memory before the first line is
written) over the same rows and reports its peak RSS too.

    python benchmarks/b6_export.py [--chunks 10000] [--dim 256]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from _common import REPO, Timer, emit, fresh_database

from pipeline_assets.store import db

MODEL_NAME = "bench-export"
CHUNKS_PER_DOC = 4

# Runs a command and prints its peak RSS in KiB (ru_maxrss of the only child).
WRAP = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL);"
    " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
)
CLI = [sys.executable, "-m", "pipeline_assets.cli"]

# The read `export` did before streaming: a client-side cursor under autocommit,
# rows converted and written one by one, but every row fetched up front.
CLIENT_SIDE = """
import json, sys
from pipeline_assets.store import retrieval
from pipeline_assets.store import db
conn = db.connect(sys.argv[1])
cur = conn.cursor()
cur.execute(retrieval.RETRIEVAL.export, {"model": sys.argv[2]})
out = sys.stdout
for document_id, source_uri, chunk_index, text, model, embedding in cur:
    out.write(json.dumps({"document_id": document_id, "source_uri": source_uri, "chunk_index": chunk_index,
                          "text": text, "model": model, "embedding": [float(x) for x in embedding.to_numpy()]}))
    out.write("\\n")
"""


def model_id(dim: int) -> str:
    return f"bench/{MODEL_NAME}@{dim}"


def load(url: str, chunks: int, dim: int) -> dict:
    """N current chunks, each with a ready job and a vector (varying per row, cheap to make)."""
    docs = -(-chunks // CHUNKS_PER_DOC)
    model = model_id(dim)
    with db.connect(url) as conn, Timer() as t:
        conn.execute(
            "INSERT INTO app.models (model_id, provider, name, dimension, max_input_tokens)"
            " VALUES (%s, 'bench', %s, %s, 8191)",
            (model, MODEL_NAME, dim),
        )
        source = conn.execute("INSERT INTO app.sources (root) VALUES ('/bench/b6') RETURNING source_id").fetchone()[0]
        conn.execute(
            "INSERT INTO app.documents (source_id, document_id, source_uri, status, chunk_count)"
            " SELECT %s, 'doc/' || g, 'file:///bench/b6/doc/' || g, 'current', %s FROM generate_series(1, %s) g",
            (source, CHUNKS_PER_DOC, docs),
        )
        conn.execute(
            "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end)"
            " SELECT d.doc_pk, k, sha256(int8send(d.doc_pk * 1000 + k)),"
            "        'chunk ' || d.doc_pk || '/' || k || ' ' || repeat('lorem ipsum ', 40), 100, 0, 500"
            " FROM app.documents d CROSS JOIN generate_series(0, %s - 1) k"
            " WHERE (d.doc_pk - 1) * %s + k < %s",
            (CHUNKS_PER_DOC, CHUNKS_PER_DOC, chunks),
        )
        with conn.transaction():  # a job and its key commit together (deferred foreign keys)
            conn.execute(
                "INSERT INTO app.embedding_jobs (chunk_checksum, model_id, status, attempts)"
                " SELECT chunk_checksum, %s, 'ready', 1 FROM app.chunks",
                (model,),
            )
            conn.execute(
                "INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)"
                " SELECT chunk_checksum, model_id, job_id FROM app.embedding_jobs"
            )
        conn.execute(
            "INSERT INTO app.embeddings (chunk_checksum, model_id, embedding)"
            " SELECT chunk_checksum, %s,"
            "        array_fill((get_byte(chunk_checksum, 0) + 1)::real / 256, ARRAY[%s])::vector"
            " FROM app.chunks",
            (model, dim),
        )
        conn.execute("VACUUM ANALYZE")
        n = conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0]
    return {"chunks": n, "load_seconds": round(t.seconds, 1)}


def peak_rss_mb(cmd: list[str], env: dict) -> tuple[float, float]:
    """(peak RSS in MB, wall seconds) of one process whose stdout goes to /dev/null."""
    with Timer() as t:
        proc = subprocess.run(
            [sys.executable, "-c", WRAP, *cmd], env=env, cwd=REPO, check=True, capture_output=True, text=True
        )
    return round(int(proc.stdout.strip().splitlines()[-1]) / 1024, 1), round(t.seconds, 1)


def measure(n: int, dim: int, env: dict, client_side: bool) -> dict:
    with fresh_database(f"b6_{n}") as url:
        out = {"load": load(url, n, dim)}
        env = {**env, "PIPELINE_DATABASE_URL": url}
        rss, seconds = peak_rss_mb([*CLI, "export", "--model", MODEL_NAME], env)
        out["export"] = {"peak_rss_mb": rss, "seconds": seconds}  # process wall time, start-up included
        if client_side:
            rss, seconds = peak_rss_mb([sys.executable, "-c", CLIENT_SIDE, url, model_id(dim)], env)
            out["client_side_cursor"] = {"peak_rss_mb": rss, "seconds": seconds}
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=10000, help="N (the second run has 10*N)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--no-client-side", action="store_true", help="skip the client-side-cursor contrast")
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_") and k != "PIPELINE_EMBEDDING_MODEL"}
    client_side = not args.no_client_side
    small = measure(args.chunks, args.dim, env, client_side)
    large = measure(args.chunks * 10, args.dim, env, client_side)
    out = {
        "benchmark": "b6_export",
        "dim": args.dim,
        "small": small,
        "large": large,
        "export_rss_ratio_10x": round(large["export"]["peak_rss_mb"] / small["export"]["peak_rss_mb"], 2),
    }
    if client_side:
        out["client_side_rss_ratio_10x"] = round(
            large["client_side_cursor"]["peak_rss_mb"] / small["client_side_cursor"]["peak_rss_mb"], 2
        )
    out["targets"] = {"export_rss_flat_within_1.25x": out["export_rss_ratio_10x"] <= 1.25}
    emit(out)


if __name__ == "__main__":
    main()
