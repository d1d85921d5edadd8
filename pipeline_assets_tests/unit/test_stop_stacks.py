"""A command that does not stop after SIGTERM says where it hangs: its threads' stacks on stderr."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from pipeline_assets_tests.processes import REPO

# Stops on the signal, then hangs in a named function instead of returning.
HANGS_AFTER_SIGTERM = textwrap.dedent("""
    import os, signal, time
    from pipeline_assets.cli.common import stop_on_signals

    def stuck_in_the_stop_path(stop):
        stop.wait(30)
        time.sleep(3)

    stop = stop_on_signals(stacks_after=0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    stuck_in_the_stop_path(stop)
""")


def test_a_stop_that_hangs_dumps_the_stacks_once():
    out = subprocess.run(
        [sys.executable, "-c", HANGS_AFTER_SIGTERM], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "stuck_in_the_stop_path" in out.stderr, out.stderr
    assert out.stderr.count("Timeout (") == 1, out.stderr  # one dump (of every thread)


def test_a_stop_that_ends_in_time_dumps_nothing():
    script = HANGS_AFTER_SIGTERM.replace("stacks_after=0.5", "stacks_after=20")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "most recent call first" not in out.stderr, out.stderr


# Blocks its main thread in a wait no signal interrupts (a lock another thread holds), then is
# asked for its stacks: the C-level handler answers all the same.
BLOCKED_MAIN_THREAD = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pipeline_assets.cli.common import STACKS_SIGNAL, stop_on_signals

    stop_on_signals()
    held = threading.Lock()
    held.acquire()

    def ask():
        time.sleep(0.5)
        os.kill(os.getpid(), STACKS_SIGNAL)
        time.sleep(1)
        sys.stderr.flush()
        os._exit(0)

    def main_thread_blocked_here():
        held.acquire()

    threading.Thread(target=ask).start()
    main_thread_blocked_here()
""")


def test_the_stacks_signal_answers_while_the_main_thread_is_blocked():
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED_MAIN_THREAD], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert "main_thread_blocked_here" in out.stderr, out.stderr


# Started with SIGTERM blocked, as a parent that blocks it while spawning leaves a child.
STARTED_WITH_SIGTERM_BLOCKED = textwrap.dedent("""
    import os, signal
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    from pipeline_assets.cli.common import stop_on_signals

    stop = stop_on_signals()
    os.kill(os.getpid(), signal.SIGTERM)
    print("stopped" if stop.wait(10) else "SIGTERM never seen")
""")


def test_a_worker_started_with_sigterm_blocked_still_stops_on_it():
    out = subprocess.run(
        [sys.executable, "-c", STARTED_WITH_SIGTERM_BLOCKED], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "stopped", (out.stdout, out.stderr)


# SIGTERM arrives while the main thread is inside one long C call that releases the GIL and never
# returns to Python (pbkdf2 here): Python's own handler would run only after it returns.
STOP_DURING_A_C_CALL = textwrap.dedent("""
    import hashlib, os, signal, threading, time
    from pipeline_assets.cli.common import stop_on_signals

    stop = stop_on_signals()
    seen = []
    threading.Thread(target=lambda: seen.append(stop.wait(60) and time.monotonic()), daemon=True).start()
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 4_000_000)  # seconds, in C, GIL released
    returned = time.monotonic()
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    print("seen_before_return" if seen and seen[0] < returned else "seen_after_return")
""")


def test_a_stop_is_seen_while_the_main_thread_is_in_a_long_c_call():
    out = subprocess.run(
        [sys.executable, "-c", STOP_DURING_A_C_CALL], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "seen_before_return", (out.stdout, out.stderr)
