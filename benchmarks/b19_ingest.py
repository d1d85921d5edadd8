"""B19 (ingest alone): `pipeline-assets ingest DIR` of b3's corpus, checkouts and settings side by side.

Each round runs every variant once, alternating, each on a fresh database it migrates itself. Per run:
`first_s` and `last_s`, process start to the start of the first and of the last ingest transaction
(documents.created_at), `wall_s` (the process, with the text-search fill and the exit), `chunks_per_s`
(chunks / wall_s) and `to_last_chunks_per_s` (chunks / last_s: `embed`'s ingest, which leaves the fill
for later), and CPU seconds: `cli_cpu_s` (the command, its extraction server and children:
/proc sampled every 50 ms, the command's own from wait4) and `db_cpu_s` (the database server's
processes over the run: the postmaster's reaped children and its live ones). Medians; `ratio` and
`to_last_ratio` are each variant's median rates over the first variant's.

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
import threading
import time
from pathlib import Path

import psycopg
from _common import emit, fresh_database, settle
from b1_cli_sdk import cli_env
from b3_rerun import write_corpus

CLI = [sys.executable, "-m", "pipeline_assets.cli"]
TIMEOUT_SECONDS = 3600
SAMPLE_SECONDS = 0.05
TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int, int, int, int] | None:
    """(ppid, utime, stime, cutime, cstime) of a process, in clock ticks; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[11]), int(fields[12]), int(fields[13]), int(fields[14])


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            tree.setdefault(st[0], []).append(int(name))
    return tree


def _descendants(root: int) -> list[int]:
    tree, found, todo = _children(), [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def server_cpu(postmaster: int) -> float:
    """CPU seconds of the database server so far: the postmaster's own, its reaped children's, its live ones'."""
    st = _stat(postmaster)
    assert st is not None
    live = sum(s[1] + s[2] for pid in _descendants(postmaster) if (s := _stat(pid)) is not None)
    return (st[1] + st[2] + st[3] + st[4] + live) / TICKS


class TreeSampler(threading.Thread):
    """The last CPU ticks seen of every descendant of ``root`` (not ``root`` itself), every SAMPLE_SECONDS."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.ticks, self.done = root, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_SECONDS):
            for pid in _descendants(self.root):
                if (st := _stat(pid)) is not None:
                    self.ticks[pid] = st[1] + st[2]

    def seconds(self) -> float:
        self.done.set()
        self.join()
        return sum(self.ticks.values()) / TICKS


def one_run(corpus: Path, checkout: str, overrides: dict[str, str]) -> dict:
    with fresh_database("ingest", migrate=False) as url:
        env = {**cli_env(url, "http://127.0.0.1:9", 256), **overrides}  # no provider call is made
        subprocess.run([*CLI, "migrate"], env=env, cwd=checkout, check=True, capture_output=True, timeout=600)
        settle(url)
        with psycopg.connect(url) as conn:
            postmaster = _stat(conn.info.backend_pid)[0]
        load = os.getloadavg()[0]
        db0 = server_cpu(postmaster)
        started, epoch0 = time.perf_counter(), time.time()
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                [*CLI, "ingest", str(corpus)], env=env, cwd=checkout, stdout=subprocess.DEVNULL, stderr=err
            )
            sampler = TreeSampler(proc.pid)
            sampler.start()
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            wall = time.perf_counter() - started
            cli_cpu = usage.ru_utime + usage.ru_stime + sampler.seconds()
            err.seek(0)
            assert proc.returncode == 0, err.read()[-2000:]
        time.sleep(0.2)  # the server reaps the command's backend
        db_cpu = server_cpu(postmaster) - db0
        with psycopg.connect(url) as conn:
            first, last = conn.execute(
                "SELECT extract(epoch FROM min(created_at)), extract(epoch FROM max(created_at)) FROM app.documents"
            ).fetchone()
            chunks = conn.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
    return {
        "first_s": round(float(first) - epoch0, 3),
        "last_s": round(float(last) - epoch0, 3),
        "wall_s": round(wall, 3),
        "chunks": chunks,
        "chunks_per_s": round(chunks / wall, 1),
        "to_last_chunks_per_s": round(chunks / (float(last) - epoch0), 1),
        "cli_cpu_s": round(cli_cpu, 2),
        "db_cpu_s": round(db_cpu, 2),
        "load": round(load, 2),
    }


KEYS = ("first_s", "last_s", "wall_s", "chunks_per_s", "to_last_chunks_per_s", "cli_cpu_s", "db_cpu_s")


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
                print(name, runs[name][-1], file=sys.stderr, flush=True)
    medians = {name: {k: round(statistics.median(r[k] for r in rs), 3) for k in KEYS} for name, rs in runs.items()}
    base = next(iter(medians.values()))
    emit(
        {
            "docs": a.docs,
            "rounds": a.rounds,
            "variants": {
                name: {
                    **medians[name],
                    "ratio": round(medians[name]["chunks_per_s"] / base["chunks_per_s"], 3),
                    "to_last_ratio": round(medians[name]["to_last_chunks_per_s"] / base["to_last_chunks_per_s"], 3),
                    "runs": rs,
                }
                for name, rs in runs.items()
            },
        }
    )


if __name__ == "__main__":
    main()
