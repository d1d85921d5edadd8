"""A hard wall-clock deadline on every provider call.

httpx times out per read: an answer that drips a byte at a time never trips a
read timeout, so without a deadline over the whole call the worker thread stays
pinned and `work --until-idle` never exits. The fake server's slow-drip fault
sends a valid answer one byte every 50 ms for `drip_seconds`.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from pipeline_assets.jobqueue.evidence import MAX_EVIDENCE_FAULTS
from pipeline_assets.jobqueue.request_plan import FREE_FAULTS
from pipeline_assets.providers import RETRYABLE, ProviderError, deadline
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import job_counts
from pipeline_assets_tests.processes import cli, wait_until

DRIP_TEXT = "DRIP an answer that trickles in forever"


def test_a_dripping_answer_ends_at_the_deadline_as_a_retryable_timeout(fake):
    fake.drip_marker, fake.drip_seconds = "DRIP", 600.0
    p = fake.provider(timeout=1.0)
    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        p.embed([DRIP_TEXT])
    elapsed = time.monotonic() - started
    # The deadline, not the 600 s drip (the upper bound is against a hang only: a loaded machine is slow).
    assert 0.9 <= elapsed < 300.0, elapsed
    err = caught.value
    assert (err.kind, err.error_class, err.billed_maybe) == (RETRYABLE, "timeout", True)
    assert fake.billed_count(DRIP_TEXT) == 1  # the provider computed (and billed) it
    # The client is still usable: the cut connection was dropped, not pooled.
    result = p.embed(["an ordinary input"])
    assert np.allclose(result.vectors[0], fake.vector_for("an ordinary input"), atol=1e-6)
    assert getattr(deadline._current, "deadline", None) is None  # no deadline left behind on the thread


def test_the_deadline_covers_the_whole_call_not_each_read(fake):
    """Each read gets data in time (every 50 ms); the whole answer takes 3 s."""
    fake.drip_marker, fake.drip_seconds = "DRIP", 3.0
    p = fake.provider(timeout=1.5)
    # A per-read timeout never fires here (a byte every 50 ms): that it times out at all is the proof.
    with pytest.raises(ProviderError, match="timeout"):
        p.embed([DRIP_TEXT])
    # With a deadline well beyond the drip, the same answer is taken.
    slow_but_in_time = fake.provider(timeout=60.0)
    result = slow_but_in_time.embed([DRIP_TEXT])
    assert np.allclose(result.vectors[0], fake.vector_for(DRIP_TEXT), atol=1e-6)


def test_deadlines_are_per_thread(fake):
    """Concurrent calls on one client: a dripping call times out, a fast one on another thread does not.

    The interleaving is forced, not hoped for: the fast call starts first and the fake holds it
    until the dripping call is on the wire (billed); released, it ends while the drip still runs.
    A deadline shared by the threads (one slot, or one per client) would be lost or overwritten
    when the fast call ends, and the drip would run for its 120 s instead of ending at its deadline.
    The deadline is generous: the fast call (held, then answered at once) must end within it on a
    loaded machine.
    """
    fake.drip_marker, fake.drip_seconds = "DRIP", 120.0
    fake.hold("FAST")
    p = fake.provider(timeout=5.0)
    outcomes: dict[str, object] = {}

    def run(name: str, text: str) -> None:
        try:
            outcomes[name] = p.embed([text])
        except ProviderError as exc:
            outcomes[name] = exc

    fast = threading.Thread(target=run, args=("fast", "FAST a fast input"))
    drip = threading.Thread(target=run, args=("drip", DRIP_TEXT))
    fast.start()
    wait_until(lambda: fake.held == 1, timeout=60, what="the fast call to reach the fake")
    drip.start()
    wait_until(lambda: fake.billed_count(DRIP_TEXT) == 1, timeout=60, what="the dripping call to be answered")
    fake.release()
    fast.join(60)
    assert not fast.is_alive() and not isinstance(outcomes["fast"], ProviderError), outcomes
    assert "drip" not in outcomes, "the drip ended before the fast call: the interleaving was not forced"
    drip.join(60)  # its deadline (5 s), not the 120 s drip
    assert not drip.is_alive(), "the dripping call outlived its deadline"
    assert isinstance(outcomes["drip"], ProviderError) and outcomes["drip"].error_class == "timeout"


def test_work_until_idle_exits_when_an_answer_drips(env, fake, clean_db, tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "drip.md").write_text(DRIP_TEXT)
    (corpus / "fine.md").write_text("an ordinary document")
    env = {**env, "PIPELINE_CALL_TIMEOUT": "1", "PIPELINE_MAX_ATTEMPTS": "2", "PIPELINE_BATCH_INPUTS": "1"}
    cli("ingest", str(corpus), env=env)
    fake.drip_marker, fake.drip_seconds = "DRIP", 3600.0
    started = time.monotonic()
    out = json.loads(cli("work", "--until-idle", "--json", env=env, timeout=240).stdout)
    elapsed = time.monotonic() - started
    print(f"\nwork --until-idle with a dripping answer exited after {elapsed:.1f} s")
    # Alone, the drip's timeouts are free until the evidence threshold and FREE_FAULTS past it, then
    # charged: at most MAX_EVIDENCE_FAULTS - 1 + FREE_FAULTS + max_attempts 1 s deadlines and backoff,
    # not as many 120 s drips (not even one).
    sends = fake.billed_count(DRIP_TEXT)
    assert FREE_FAULTS + 2 <= sends <= MAX_EVIDENCE_FAULTS - 1 + FREE_FAULTS + 2
    assert elapsed < 300, elapsed  # against a hang only: one drip alone would be an hour
    conn = clean_db
    assert job_counts(conn) == {"ready": 1, "failed": 1}
    assert conn.execute("""SELECT j.error_class, j.attempts FROM app.embedding_jobs j
                           WHERE j.status = 'failed'""").fetchone() == ("timeout", 2)
    assert out["embedded"] == 1 and out["failed"] == 1
    # Each timed-out send was billed by the provider, and the ledger counts it as
    # possibly billed, with its estimated tokens (not 0).
    calls = conn.execute("""SELECT outcome, billed, tokens, answered_at IS NOT NULL FROM app.provider_calls
                            WHERE outcome <> 'ok' AND inputs > 0 ORDER BY call_id""").fetchall()
    assert [(o, b, a) for o, b, _, a in calls] == [("timeout", "maybe", True)] * sends
    assert all(tokens > 0 for _, _, tokens, _ in calls)
    counted = conn.execute(
        """SELECT s.sends FROM app.input_sends s JOIN app.chunks c USING (chunk_checksum)
                              WHERE c.text = %s""",
        (DRIP_TEXT,),
    ).fetchone()[0]
    assert counted == fake.billed_count(DRIP_TEXT) == sends
    spend = json.loads(cli("status", "--json", env=env).stdout)["spend"][f"openai/{FAKE_MODEL}"]
    assert (spend["duplicate_inputs"], spend["extra_sends"]) == (1, sends - 1)
