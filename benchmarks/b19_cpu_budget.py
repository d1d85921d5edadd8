"""B19's CPU budget: where one `embed DIR` spends its CPU-seconds, by role, against the floor's.

On 2 cores `embed` is CPU-bound (wall ~ total CPU / 2), so CPU-seconds, the same under `nice` or beside
other work, say what a change can win. One round on a fresh database of the server under PIPELINE_HOME
(a server of your own: all its postmaster's children are counted), with b19_end_to_end's corpus, fake
and floor: the CPU of each thread of `embed`, of its children, of every server process (by what it
runs) and of the fake, split by phase; the floor's parts with the CPU-seconds around each.
What each row means: benchmarks/README.md, B19.

    python benchmarks/b19_cpu_budget.py [--docs 10000] [--dim 256] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from _common import emit, fresh_database, settle, start_fake
from _sdk_alone import KEY, sdk_alone
from b1_cli_sdk import cli_env
from b3_rerun import write_corpus
from b19_end_to_end import CLI, bare_tables, copy_alone, corpus_slices, index_alone, tokenize_alone

from pipeline_assets.content.sandbox import usable_cores
from pipeline_assets.jobqueue.worker_config import DEFAULT_CONCURRENCY
from pipeline_assets.settings import Settings

SAMPLE_SECONDS = 0.05
TICK = os.sysconf("SC_CLK_TCK")
# Names each Python thread of `embed` after its threading name (visible in /proc/<pid>/task/*/comm).
NAMING_HOOK = (
    "import ctypes, runpy, threading\n"
    "libc = ctypes.CDLL(None)\n"
    "run = threading.Thread.run\n"
    "def named(self):\n"
    "    libc.prctl(15, self.name.encode()[:15], 0, 0, 0)\n"
    "    run(self)\n"
    "threading.Thread.run = named\n"
    "runpy.run_module('pipeline_assets.cli', run_name='__main__')\n"
)


def cpu(path: str) -> tuple[str, float] | None:
    """(comm, CPU-seconds) of /proc/<pid>[/task/<tid>]/stat, None once gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return comm, (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    return seen[1:]


def tree_cpu(pid: int) -> float:
    return sum((cpu(f"/proc/{p}/stat") or ("", 0.0))[1] for p in [pid, *descendants(pid)])


def server_cpu(postmaster: int) -> float:
    """CPU-seconds of the server's processes running now and of those it has reaped (parallel workers)."""
    with open(f"/proc/{postmaster}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[13]) + int(fields[14])) / TICK + tree_cpu(postmaster)


def statement(query: str) -> str:
    q = re.sub(r"\s+", " ", query).strip()
    return q[:70]


class Sampler:
    """Per-role CPU deltas of `embed`'s threads and children, the server's processes, the fake."""

    def __init__(self, embed_pid: int, postmaster: int, fake_pid: int, url: str) -> None:
        self.embed, self.postmaster, self.fake = embed_pid, postmaster, fake_pid
        self.conn = psycopg.connect(url, autocommit=True)
        self.me = self.conn.info.backend_pid
        self.last: dict[str, float] = {}
        self.samples: list[tuple[float, str, float]] = []  # (epoch, role, CPU-s since the last sample)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        for path in self.roles():  # what the server and the fake spent before `embed` is not counted
            got = None if path.startswith(f"/proc/{embed_pid}/") else cpu(path)
            if got is not None:
                self.last[path] = got[1]

    def roles(self) -> dict[str, str]:
        """{/proc path: role} of every process and thread counted now."""
        out = {}
        for task in Path(f"/proc/{self.embed}/task").glob("*"):
            out[f"{task}/stat"] = "embed thread"
        for p in descendants(self.embed):
            out[f"/proc/{p}/stat"] = "embed child"
        out[f"/proc/{self.fake}/stat"] = "fake"
        activity = {
            pid: (btype, state, q)
            for pid, btype, state, q in self.conn.execute(
                "SELECT pid, backend_type, coalesce(state, ''), coalesce(query, '') FROM pg_stat_activity"
            ).fetchall()
        }
        for p in children(self.postmaster):
            if p == self.me:
                continue
            btype, state, q = activity.get(p, ("?", "", ""))
            shown = statement(q) if state.startswith("active") or btype == "parallel worker" else state
            out[f"/proc/{p}/stat"] = f"server {btype}: {shown}"
        return out

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.time()
            for path, role in self.roles().items():
                got = cpu(path)
                if got is None:
                    continue
                comm, seconds = got
                if role == "embed thread":
                    tid = path.split("/")[4]
                    role = "embed main thread" if tid == str(self.embed) else f"embed thread {comm}"
                delta = seconds - self.last.get(path, 0.0)
                self.last[path] = seconds
                if delta > 0:
                    self.samples.append((now, role, delta))
            self.stop.wait(SAMPLE_SECONDS)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        self.conn.close()


def postmaster_of(url: str) -> int:
    with psycopg.connect(url) as conn:
        backend = conn.info.backend_pid
    with open(f"/proc/{backend}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def measured(fake_pid: int, postmaster: int, fn) -> dict:
    """CPU-seconds of this process, the fake and the server around ``fn()``, and its wall."""
    me0, fake0, srv0, t0 = time.process_time(), tree_cpu(fake_pid), server_cpu(postmaster), time.perf_counter()
    fn()
    return {
        "wall_s": round(time.perf_counter() - t0, 3),
        "self_cpu_s": round(time.process_time() - me0, 3),
        "fake_cpu_s": round(tree_cpu(fake_pid) - fake0, 3),
        "server_cpu_s": round(server_cpu(postmaster) - srv0, 3),
    }


def floor_cpu(url: str, pool, a, base_url: str, fake_pid: int, postmaster: int) -> dict:
    threads, batch = DEFAULT_CONCURRENCY, Settings.from_env().provider_config().request_inputs
    texts, rows = next(corpus_slices(pool, a.docs))  # one slice: --docs <= FLOOR_SLICE_DOCS
    inputs = [r[3] for r in rows]
    sdk_alone(base_url, inputs, threads=threads, batch=batch, dim=a.dim)  # warm the fake's vectors
    out = {"chunks": len(rows)}
    with bare_tables(url, a.dim) as conn:
        out["tokenize"] = measured(fake_pid, postmaster, lambda: tokenize_alone(texts))
        out["sdk"] = measured(
            fake_pid, postmaster, lambda: sdk_alone(base_url, inputs, threads=threads, batch=batch, dim=a.dim)
        )
        out["copy"] = measured(fake_pid, postmaster, lambda: copy_alone(conn, rows, a.dim, 0))
        out["index"] = measured(fake_pid, postmaster, lambda: index_alone(conn, a.dim, len(rows)))
    return out


def phase(t: float, first_send: float, last_answer: float) -> str:
    return "to_first_send" if t < first_send else "sending" if t <= last_answer else "after_last_answer"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--top", type=int, default=40, help="roles listed (largest first)")
    a = p.parse_args()
    fake, base_url = start_fake("--dim", str(a.dim), "--api-key", KEY)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="b19cpu-") as tmp,
            multiprocessing.get_context("fork").Pool(usable_cores()) as pool,
            fresh_database("cpu", migrate=False) as url,
        ):
            corpus = Path(tmp) / "corpus"
            write_corpus(corpus, a.docs)
            env = cli_env(url, base_url, a.dim)
            subprocess.run([*CLI, "migrate"], env=env, check=True, capture_output=True, timeout=600)
            postmaster = postmaster_of(url)
            floor = floor_cpu(url, pool, a, base_url, fake.pid, postmaster)
            settle(url)
            load0 = os.getloadavg()
            started = time.time()
            proc = subprocess.Popen(
                [sys.executable, "-c", NAMING_HOOK, "embed", str(corpus), "--json"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            sampler = Sampler(proc.pid, postmaster, fake.pid, url)
            sampler.thread.start()
            out, err = proc.communicate(timeout=3600)
            ended = time.time()
            sampler.finish()
            assert proc.returncode == 0, err[-2000:]
            with psycopg.connect(url) as conn:
                first, last = conn.execute(
                    "SELECT extract(epoch FROM min(called_at)), extract(epoch FROM max(answered_at))"
                    " FROM app.provider_calls"
                ).fetchone()
        by: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        span: dict[str, list[float]] = {}
        for t, role, d in sampler.samples:
            by[role][phase(t, float(first), float(last))] += d
            seen = span.setdefault(role, [t, t])
            seen[1] = t
        # When each role ran: seconds from the last answer (negative: before it), first and last sample.
        table = sorted(((sum(c.values()), role, dict(c)) for role, c in by.items()), reverse=True)
        emit(
            {
                "docs": a.docs,
                "load": [load0, os.getloadavg()],
                "embed_wall_s": round(ended - started, 3),
                "phases_s": [round(x, 3) for x in (float(first) - started, float(last - first), ended - float(last))],
                "embed_cpu_s": round(sum(d for _, _, d in sampler.samples), 3),
                "summary": json.loads(out),
                "floor": floor,
                "roles": [
                    {
                        "role": role,
                        "cpu_s": round(total, 3),
                        **{k: round(v, 3) for k, v in c.items()},
                        "from_last_answer_s": [round(x - float(last), 2) for x in span[role]],
                    }
                    for total, role, c in table[: a.top]
                ],
            }
        )
    finally:
        fake.terminate()
        fake.wait(10)


if __name__ == "__main__":
    main()
