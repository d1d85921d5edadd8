"""The userspace link emulator on its own (no root): a real relay process between a client and an
echo server on this host's loopback. Timings are asserted only as lower bounds (a loaded machine is
slower, never faster)."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from pipeline_assets_tests.processes import REPO, stop_group

pytestmark = pytest.mark.timeout(120)
DELAY = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def echo():
    """An echo server on the loopback: yields its port."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(timeout=5)
    srv.close()


def start_relay(upstream: int, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline_assets_tests.topology.linkrelay",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            f"127.0.0.1:{upstream}",
            *args,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert "listening" in json.loads(proc.stdout.readline())
    return proc, port


def stop_relay(proc: subprocess.Popen) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    stop_group(proc, signal.SIGTERM, grace=5)
    return json.loads(out.strip().splitlines()[-1])["stats"]


def round_trip(conn: socket.socket, payload: bytes) -> float:
    started = time.monotonic()
    conn.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += conn.recv(65536)
    assert got == payload
    return time.monotonic() - started


def test_each_round_trip_crosses_the_delay_twice_and_order_is_kept(echo):
    proc, port = start_relay(echo, "--delay", str(DELAY), "--loss", "0")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            times = [round_trip(conn, b"ping%02d" % i) for i in range(10)]
            # Many writes back to back: delivered whole and in order, though each chunk is delayed.
            burst = b"".join(b"<%04d>" % i for i in range(2000))
            for i in range(0, len(burst), 60):
                conn.sendall(burst[i : i + 60])
            got = b""
            while len(got) < len(burst):
                got += conn.recv(65536)
            assert got == burst
    finally:
        stats = stop_relay(proc)
    assert min(times) >= 2 * DELAY
    assert stats["connections"] == 1 and stats["stalls_up"] == stats["stalls_down"] == 0
    assert stats["bytes_up"] == stats["bytes_down"] == 10 * 6 + len(burst)


def test_a_lost_chunk_stalls_one_rto_and_what_follows_waits_behind_it(echo):
    """A seed whose first draw loses and second does not: the first chunk stalls one RTO; the
    second, written right behind it and not lost, still arrives after it (TCP's in-order delivery)."""
    rto, loss = 0.3, 0.5
    seed = next(s for s in range(1000) if (r := random.Random(s)).random() < loss <= r.random())
    proc, port = start_relay(echo, "--delay", str(DELAY), "--loss", str(loss), "--rto", str(rto), "--seed", str(seed))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            started = time.monotonic()
            conn.sendall(b"a")
            time.sleep(0.01)
            conn.sendall(b"b")
            got = b""
            while len(got) < 2:
                got += conn.recv(16)
            both = time.monotonic() - started
    finally:
        stats = stop_relay(proc)
    assert got == b"ab"
    assert both >= 2 * DELAY + rto
    assert stats["stalls_up"] >= 1
