"""The per-document wall-clock limit and memory limit on extract + chunk: the
extraction runs in a child process that is killed at its deadline, so a stall
in C code, a parser that swallows exceptions, a run off the main thread or an
input that inflates past the memory limit quarantines only its document."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pipeline_assets.app.ingest import ingest_directory
from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.app.runtime import IngestOptions
from pipeline_assets.content.chunking import Chunker
from pipeline_assets_tests.poison_chunker import PARENT_LOCK, POISON_TEXT, PoisonChunker, under_the_parents_lock

# The per-document deadline of these tests: far below the poison's stall (300 s, or minutes of C
# code), and far above what a fine document needs (milliseconds), so a loaded machine does not
# quarantine the fine ones.
STAGE_TIMEOUT = 2.0


def _corpus(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    # The poison document comes first: the one after it needs a fresh child.
    (corpus / "a-poison.md").write_text(POISON_TEXT)
    (corpus / "b-fine.md").write_text("an ordinary document")
    (corpus / "c-fine.md").write_text("another ordinary document")
    return corpus


# Extraction children of these ingests: a pool, whatever the machine's cores.
POOL = 2


def _ingest(conn, corpus, chunker: Chunker | None = None, **config):
    config.setdefault("extract_processes", POOL)
    return ingest_directory(
        conn, corpus, IngestOptions(chunker=chunker or Chunker(), config=IngestConfig(max_bytes=1 << 20, **config))
    )


def _assert_only_poison_quarantined(conn, report, error_class):
    assert report.quarantined == 1 and report.errors == {error_class: 1}, report
    rows = dict(
        conn.execute("SELECT document_id, status || ':' || coalesce(error_class, '') FROM app.documents").fetchall()
    )
    assert rows == {"a-poison.md": f"quarantined:{error_class}", "b-fine.md": "current:", "c-fine.md": "current:"}
    assert conn.execute("SELECT count(*) FROM app.chunks").fetchone()[0] == 2
    stage = conn.execute(
        "SELECT s.status, s.error_class FROM app.stage_runs s JOIN app.documents d USING (doc_pk)"
        " WHERE d.document_id = 'a-poison.md' AND s.stage = 'extract'"
    ).fetchone()
    assert stage == ("failed", error_class)


def test_a_stalling_parser_quarantines_only_its_document(clean_db, tmp_path):
    started = time.monotonic()
    report = _ingest(clean_db, _corpus(tmp_path), stage_timeout=STAGE_TIMEOUT, chunker=PoisonChunker("stall"))
    assert time.monotonic() - started < 60  # cut at its deadline, not the 300 s stall
    _assert_only_poison_quarantined(clean_db, report, "timeout")
    # What the user reads (status, dlq show): where the parser was stuck, and that it was tried twice.
    message = clean_db.execute("SELECT error_message FROM app.documents WHERE document_id = 'a-poison.md'").fetchone()[
        0
    ]
    assert "(2 times, each in a fresh process); stuck in _stall (pipeline_assets_tests/poison_chunker.py:" in message, (
        message
    )


def test_a_stall_in_c_code_is_killed_at_its_deadline(clean_db, tmp_path):
    # A signal handler cannot run inside one C call (SIGALRM fired only after it ended).
    started = time.monotonic()
    report = _ingest(clean_db, _corpus(tmp_path), stage_timeout=STAGE_TIMEOUT, chunker=PoisonChunker("stall_in_c"))
    assert time.monotonic() - started < 60  # killed at its deadline, not minutes later
    _assert_only_poison_quarantined(clean_db, report, "timeout")


def test_a_parser_that_swallows_exceptions_is_still_stopped(clean_db, tmp_path):
    started = time.monotonic()
    report = _ingest(clean_db, _corpus(tmp_path), stage_timeout=STAGE_TIMEOUT, chunker=PoisonChunker("swallow"))
    assert time.monotonic() - started < 60  # stopped at its deadline, not after 300 s
    _assert_only_poison_quarantined(clean_db, report, "timeout")


def test_the_limit_holds_off_the_main_thread(clean_db, tmp_path):
    """A Dagster run or a sensor ingests off the main thread, where SIGALRM cannot be used."""
    corpus = _corpus(tmp_path)
    result = {}
    started = time.monotonic()
    t = threading.Thread(
        target=lambda: result.update(
            report=_ingest(clean_db, corpus, stage_timeout=STAGE_TIMEOUT, chunker=PoisonChunker("stall"))
        )
    )
    t.start()
    t.join(120)
    assert not t.is_alive() and time.monotonic() - started < 60  # not the 300 s stall
    _assert_only_poison_quarantined(clean_db, result["report"], "timeout")


def test_an_extraction_over_the_memory_limit_is_quarantined(clean_db, tmp_path):
    report = _ingest(clean_db, _corpus(tmp_path), extract_memory=256 * 1024 * 1024, chunker=PoisonChunker("inflate"))
    _assert_only_poison_quarantined(clean_db, report, "memory_limit")


def test_a_parser_that_crashes_its_process_is_one_documents_error(clean_db, tmp_path):
    report = _ingest(clean_db, _corpus(tmp_path), chunker=PoisonChunker("crash"))
    _assert_only_poison_quarantined(clean_db, report, "extract_crashed")


def test_a_bug_in_a_parser_is_one_documents_error(clean_db, tmp_path):
    report = _ingest(clean_db, _corpus(tmp_path), chunker=PoisonChunker("bug"))
    _assert_only_poison_quarantined(clean_db, report, "extract_failed")


# -- the sandbox itself ---------------------------------------------------------------------
def _nap(seconds: float, value):
    time.sleep(seconds)
    return value


@pytest.mark.parametrize("processes", [1, POOL])
def test_each_queued_call_has_its_own_deadline_and_a_kill_loses_nothing_queued(processes):
    from pipeline_assets.content.extract import ExtractError
    from pipeline_assets.content.sandbox import CALL_ATTEMPTS, Sandbox

    # Each nap is well inside its own 2 s deadline (slack for a loaded machine); together they are not.
    with Sandbox(_nap, timeout=2.0, memory_limit=0, processes=processes) as box:
        calls = [(0.6, "a"), (0.6, "b"), (3600, "stuck"), (0.6, "c"), (0.6, "d"), (0, b"x" * (3 << 20))]
        outcomes = []
        for i, args in enumerate(calls):
            while not box.submit(i, *args):
                outcomes.append(box.take())
        while box.pending:
            outcomes.append(box.take())
        # Each child started once; the stuck call killed twice (it is sent once more, to a fresh child).
        assert box.starts == processes + CALL_ATTEMPTS and box.resent == 1
    if processes == 1:
        assert [tag for tag, _ in outcomes] == list(range(len(calls)))  # one child answers in order
    values = {tag: o if not isinstance(o, ExtractError) else o.error_class for tag, o in outcomes}
    # 0.6 s each, queued together (2.4 s): none charged for the time spent waiting behind the others.
    assert len(outcomes) == len(calls)
    assert [values[i] for i in range(len(calls))] == ["a", "b", "timeout", "c", "d", b"x" * (3 << 20)]
    # The timeout says where the child was stuck: the napping function, in this file.
    message = dict(outcomes)[2].message
    where = "stuck in _nap (integration/test_stage_timeout.py:"
    assert f"({CALL_ATTEMPTS} times, each in a fresh process); {where}" in message, message


def _hang_once(marker: str, value):
    """Hangs the first time (as a child forked at a bad moment might), answers the second."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(3600)
    return value


def test_a_call_that_hangs_once_is_answered_by_a_fresh_child(tmp_path):
    from pipeline_assets.content.sandbox import Sandbox

    with Sandbox(_hang_once, timeout=2.0, memory_limit=0, processes=1) as box:
        for i in range(3):
            assert box.submit(i, str(tmp_path / "hung"), f"v{i}")
        outcomes = [box.take() for _ in range(3)]
        assert box.resent == 1 and box.starts == 2
    assert outcomes == [(0, "v0"), (1, "v1"), (2, "v2")]  # nothing lost, still in order


def _kill_the_second_child_started(monkeypatch) -> list[int]:
    """From now on, the second extraction child started dies right after it starts, before
    anything is sent to it. Returns the pids of the children started."""
    from pipeline_assets.content import sandbox_child

    real_start, started = sandbox_child.Child.start, []

    def start(self, fn, memory_limit):
        real_start(self, fn, memory_limit)
        started.append(self.proc.pid)
        if len(started) == 2:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(30)

    monkeypatch.setattr(sandbox_child.Child, "start", start)
    return started


def test_a_fresh_child_that_dies_before_its_calls_are_sent_loses_none(monkeypatch):
    """A call sent again can crash its fresh child before the calls queued behind it are sent
    (a crashing parser, at once): those calls go to the next child, none is lost."""
    from pipeline_assets.content.extract import ExtractError
    from pipeline_assets.content.sandbox import Sandbox

    started = _kill_the_second_child_started(monkeypatch)  # the child replacing the first
    with Sandbox(_nap, timeout=60.0, memory_limit=0, processes=1) as box:
        for i, args in enumerate([(3600, "a"), (0, "b"), (0, "c")]):
            assert box.submit(i, *args)
        os.kill(box.pids[0], signal.SIGKILL)  # the first child dies with three calls queued on it
        outcomes = dict(box.take() for _ in range(3))
        assert len(started) == 3 and box.pending == 0
    assert isinstance(outcomes[0], ExtractError) and outcomes[0].error_class == "extract_crashed"
    assert (outcomes[1], outcomes[2]) == ("b", "c")


def test_a_call_submitted_to_a_dead_child_is_answered_even_if_its_replacement_dies(monkeypatch):
    from pipeline_assets.content.sandbox import Sandbox

    started = _kill_the_second_child_started(monkeypatch)
    with Sandbox(_nap, timeout=60.0, memory_limit=0, processes=1) as box:
        assert box.call(0, "warm") == "warm"
        os.kill(box.pids[0], signal.SIGKILL)  # an idle child gone (the OOM killer, say)
        box._children[0].proc.join(30)
        assert box.submit("x", 0, "x")  # its pipe is broken: to a new child, which dies too
        assert box.take() == ("x", "x") and len(started) == 3


def test_a_stuck_call_in_one_child_does_not_hold_up_or_lose_the_others():
    from pipeline_assets.content.extract import ExtractError
    from pipeline_assets.content.sandbox import Sandbox
    from pipeline_assets.content.sandbox_child import MAX_QUEUED_CALLS

    quick = 4 * MAX_QUEUED_CALLS
    with Sandbox(_nap, timeout=10.0, memory_limit=0, processes=POOL) as box:
        outcomes = []
        for i, args in enumerate([(3600, "stuck")] + [(0, f"v{k}") for k in range(quick)]):
            while not box.submit(i, *args):
                outcomes.append(box.take())
        while box.pending:
            outcomes.append(box.take())
    values = {tag: o if not isinstance(o, ExtractError) else o.error_class for tag, o in outcomes}
    assert len(outcomes) == quick + 1 and values == {0: "timeout", **{k + 1: f"v{k}" for k in range(quick)}}
    # Only the calls queued behind the stuck one on its own child waited for its deadline:
    # the other child answered the rest first.
    answered_before_the_kill = [tag for tag, _ in outcomes].index(0)
    assert answered_before_the_kill >= quick - MAX_QUEUED_CALLS


def test_a_pool_of_children_writes_what_one_child_writes(clean_db, tmp_path):
    """Same documents, chunks, checksums and jobs whether one child or a pool extracts."""
    corpus = tmp_path / "mixed"
    for i in range(120):
        words = " ".join(f"w{(i * 13 + j) % 701}" for j in range(40 + (i % 7) * 220))
        path = corpus / f"d{i % 5}" / (f"doc{i:03d}.html" if i % 4 == 0 else f"doc{i:03d}.md")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<html><body><p>{words}</p></body></html>" if i % 4 == 0 else f"# doc {i}\n\n{words}\n")

    def written(processes: int) -> tuple[list, list, dict]:
        clean_db.execute(
            "TRUNCATE app.sources, app.documents, app.chunks, app.embedding_jobs, app.job_keys, app.stage_runs CASCADE"
        )
        report = _ingest(clean_db, corpus, extract_processes=processes, chunker=Chunker(max_tokens=64, overlap=8))
        docs = clean_db.execute(
            "SELECT document_id, status, source_checksum, text_checksum FROM app.documents ORDER BY document_id"
        ).fetchall()
        chunks = clean_db.execute(
            "SELECT d.document_id, c.chunk_index, c.chunk_checksum, c.text, c.token_count,"
            " c.char_start, c.char_end FROM app.chunks c JOIN app.documents d USING (doc_pk)"
            " ORDER BY 1, 2"
        ).fetchall()
        assert report.scanned == 120 and report.new == 120 and report.quarantined == 0, report
        return docs, chunks, {k: v for k, v in report.as_dict().items() if k != "errors"}

    serial = written(1)
    assert len(serial[1]) > 200  # several chunks per document
    assert written(POOL) == serial


def test_the_child_does_not_outlive_a_killed_parent(tmp_path):
    import subprocess
    import sys

    # A script without a main guard: the child must not run it again.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os, signal\n"
        "from pipeline_assets.content.sandbox import Sandbox\n"
        "box = Sandbox(abs, timeout=5, memory_limit=0)\n"
        "assert box.call(-1) == 1\n"
        "print(box.pids[0], flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return  # exited (a zombie until init reaps it)
        time.sleep(0.1)
    raise AssertionError(f"extraction child {child} still running after its parent was killed")


def test_a_lock_another_thread_holds_does_not_reach_the_child():
    """The caller's threads (a connection pool, a Dagster run's, a beat) may hold a lock when a child
    starts: a child forked from the caller would start with it held and wait on it forever."""
    from pipeline_assets.content.sandbox import Sandbox

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with PARENT_LOCK:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        with Sandbox(under_the_parents_lock, timeout=STAGE_TIMEOUT * 5, memory_limit=0) as box:
            assert box.call("answered") == "answered"
    finally:
        release.set()
        holder.join(60)
