"""Progress: `embed` and `work --until-idle` draw a bar (rate, ETA) on a terminal
and print exactly what they always did when piped; `status --watch` refreshes
until Ctrl-C (or `--count` refreshes)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import REPO, cli, kill_group, start_cli, wait_until

SUMMARY_KEYS = [
    "model",
    "documents",
    "documents_changed",
    "quarantined",
    "deleted",
    "chunks",
    "embedded",
    "reused",
    "failed",
    "provider_calls",
    "coverage",
    "seconds",
]


def test_piped_output_is_unchanged(env, fake, clean_db, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 8)
    proc = cli("embed", str(corpus), env=env)
    assert proc.stderr == ""  # no bar, no escape codes, no log line
    (line,) = proc.stdout.splitlines()
    assert [kv.split("=", 1)[0] for kv in line.split()] == SUMMARY_KEYS
    assert "embedded=8 " in line and "coverage=8/8 " in line and "\x1b" not in line
    (corpus / "doc0000.md").write_text("# changed\n\nnew words here\n")
    cli("ingest", str(corpus), env=env)
    work = cli("work", "--until-idle", env=env)
    assert work.stderr == ""
    (line,) = work.stdout.splitlines()
    assert line.startswith("embedded=1 ") and "\x1b" not in line


def _run_on_a_terminal(args: list[str], env: dict, timeout: float = 120) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (80x24), stdout on a pipe."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline_assets.cli", *args],
        cwd=REPO,
        env={**env, "TERM": "xterm-256color"},
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal closed: the process is gone
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    out = proc.stdout.read().decode()
    proc.wait(timeout=30)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_a_progress_bar(env, fake, clean_db, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 30)
    (corpus / "bad.md").write_text("# bad\n\nPOISONED input\n")
    fake.poison_marker = "POISONED"  # one dead letter: a warning printed above the bar, not through it
    fake.latency = 0.05
    code, out, term = _run_on_a_terminal(
        ["embed", str(corpus), "--concurrency", "1"], {**env, "PIPELINE_BATCH_INPUTS": "4"}
    )
    assert code == 0, term
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", term)
    assert "embedding" in plain and "jobs/s" in plain and "eta" in plain, plain[-2000:]
    assert "31/31" in plain, plain[-2000:]  # the bar ends at the whole queue (the dead letter counts)
    flat = " ".join(plain.split())  # the terminal is 100 columns wide: a long line wraps
    assert re.search(
        r"\d WARNING pipeline_assets.jobqueue: job dead-lettered \(bad_input\) \[job_id=\d+ "
        r"document_id=bad.md attempt=1 ",
        flat,
    ), plain[-3000:]
    (line,) = out.splitlines()  # stdout is still the one summary line
    assert "embedded=30 " in line


def test_status_watch_refreshes_count_times(env, clean_db):
    proc = cli("status", "--watch", "0.2", "--count", "3", env=env, timeout=60)
    blocks = [ln for ln in proc.stdout.splitlines() if ln.startswith("status at ")]
    assert len(blocks) == 3 and all("every 0.2 s" in b for b in blocks)
    assert proc.stdout.count("jobs: ") == 3
    js = cli("status", "--json", "--watch", "0.2", "--count", "2", env=env, timeout=60)
    rows = [json.loads(ln) for ln in js.stdout.splitlines()]
    assert len(rows) == 2 and all("at" in r and "jobs" in r for r in rows)


def test_status_watch_runs_until_ctrl_c(env, clean_db):
    proc = start_cli("status", "--watch", "0.2", env=env)
    seen = []

    def refreshes() -> int:  # what it printed so far (read in its own thread: a pipe blocks)
        return "".join(seen).count("status at ")

    reader = threading.Thread(target=lambda: seen.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: refreshes() >= 3 or proc.poll() is not None, timeout=120, what="three refreshes")
        assert proc.poll() is None, "it stopped by itself"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert proc.returncode == 0, err
    assert refreshes() >= 3  # refreshed while it ran
    assert "Traceback" not in err
