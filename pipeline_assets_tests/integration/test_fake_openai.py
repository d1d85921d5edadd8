"""Tests for the fake OpenAI embeddings server, exercised through the real ``openai`` SDK."""

from __future__ import annotations

import base64
import http.client
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest

from pipeline_assets_tests.fake_openai import FakeOpenAI
from pipeline_assets_tests.fake_openai_wire import count_tokens, fetch_stats, post_faults
from pipeline_assets_tests.processes import wait_until

MODEL = "text-embedding-3-small"
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server():
    with FakeOpenAI(dim=16) as srv:
        yield srv


def make_client(srv_or_url, key: str = "test-key", timeout: float = 5.0) -> openai.OpenAI:
    url = srv_or_url if isinstance(srv_or_url, str) else srv_or_url.base_url
    return openai.OpenAI(api_key=key, base_url=url, max_retries=0, timeout=timeout)


@pytest.fixture
def client(server):
    c = make_client(server)
    yield c
    c.close()


def raw_post(srv: FakeOpenAI, body: dict) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    try:
        conn.request(
            "POST",
            "/v1/embeddings",
            json.dumps(body),
            {"Authorization": "Bearer test-key", "Content-Type": "application/json"},
        )
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), json.loads(r.read())
    finally:
        conn.close()


# ---- happy path ------------------------------------------------------------------------------
def test_default_base64_returns_expected_vector(server, client):
    resp = client.embeddings.create(model=MODEL, input="hello world")  # SDK sends base64 by default
    emb = resp.data[0].embedding
    assert len(emb) == 16
    assert np.allclose(emb, server.vector_for("hello world"), atol=0)
    assert np.isclose(np.linalg.norm(emb), 1.0, atol=1e-5)
    assert resp.model == MODEL and resp.object == "list"
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == count_tokens("hello world")
    # deterministic: a different server instance gives the same vector; different text differs
    assert server.vector_for("hello world") == FakeOpenAI(dim=16).vector_for("hello world")
    assert not np.allclose(emb, server.vector_for("hello world!"))


def test_wire_format_is_openai_shaped(server):
    status, headers, body = raw_post(server, {"model": MODEL, "input": ["a", "b"], "encoding_format": "base64"})
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["data"][1]["object"] == "embedding" and body["data"][1]["index"] == 1
    decoded = np.frombuffer(base64.b64decode(body["data"][1]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.asarray(server.vector_for("b"), dtype=np.float32))
    status, _, body = raw_post(server, {"model": MODEL, "input": "a"})  # no encoding_format -> float
    assert status == 200 and isinstance(body["data"][0]["embedding"], list)


def test_float_format_and_dimensions(server, client):
    resp = client.embeddings.create(model=MODEL, input="abc", encoding_format="float")
    assert np.allclose(resp.data[0].embedding, server.vector_for("abc"))
    resp = client.embeddings.create(model=MODEL, input="abc", dimensions=8)
    assert len(resp.data[0].embedding) == 8
    assert np.allclose(resp.data[0].embedding, server.vector_for("abc", dim=8))


def test_batch_keeps_index_order_and_token_inputs(server, client):
    texts = [f"document number {i}" for i in range(7)]
    resp = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in resp.data] == list(range(7))
    for d, t in zip(resp.data, texts):
        assert np.allclose(d.embedding, server.vector_for(t))
    assert resp.usage.prompt_tokens == sum(count_tokens(t) for t in texts)
    resp = client.embeddings.create(model=MODEL, input=[[1, 2, 3], [4, 5]])
    assert np.allclose(resp.data[1].embedding, server.vector_for([4, 5]))
    assert resp.usage.prompt_tokens == 5


def test_billed_counting_and_reset(server, client):
    client.embeddings.create(model=MODEL, input=["x", "y"])
    client.embeddings.create(model=MODEL, input="x")
    s = server.stats
    assert s["requests"] == 2 and s["billed_inputs"] == 3
    assert s["billed_tokens"] == 2 * count_tokens("x") + count_tokens("y")
    assert s["responses_by_status"] == {200: 2}
    assert s["billed_by_text"] == {"x": 2, "y": 1}
    assert server.billed_count("x") == 2 and server.billed_count("nope") == 0
    server.reset_stats()
    assert server.stats["requests"] == 0 and server.billed_count("x") == 0


def test_invalid_input_is_400(server, client):
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=[])
    assert server.stats["billed_inputs"] == 0


# ---- faults ----------------------------------------------------------------------------------
def test_fail_next_429_with_retry_after(server, client):
    server.fail_next(1, 429, retry_after="0.2")
    with pytest.raises(openai.RateLimitError) as ei:
        client.embeddings.create(model=MODEL, input="a")
    assert ei.value.status_code == 429
    assert ei.value.response.headers["retry-after"] == "0.2"
    assert server.billed_count("a") == 0
    client.embeddings.create(model=MODEL, input="a")  # only one failure was injected
    assert server.billed_count("a") == 1
    assert server.stats["responses_by_status"] == {429: 1, 200: 1}


def test_fail_next_5xx(server, client):
    server.fail_next(2, 500)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            client.embeddings.create(model=MODEL, input="a")
    server.fail_next(1, 503, body={"error": {"message": "overloaded", "type": "server_error"}})
    with pytest.raises(openai.InternalServerError, match="overloaded"):
        client.embeddings.create(model=MODEL, input="a")
    assert server.stats["billed_inputs"] == 0


def test_poison_marker_rejects_whole_request(server, client):
    server.poison_marker = "<<POISON>>"
    with pytest.raises(openai.BadRequestError, match="index 1"):
        client.embeddings.create(model=MODEL, input=["ok", "bad <<POISON>> text", "ok2"])
    assert server.stats["billed_inputs"] == 0 and server.billed_count("ok") == 0
    client.embeddings.create(model=MODEL, input=["ok"])
    assert server.billed_count("ok") == 1


def test_drop_next_bills_but_connection_errors(server, client):
    client.embeddings.create(model=MODEL, input="warm")  # keep-alive connection in the pool
    server.drop_next(1)
    t0 = time.monotonic()
    with pytest.raises(openai.APIConnectionError):
        client.embeddings.create(model=MODEL, input="dropped")
    assert time.monotonic() - t0 < 4.5  # an abort, not the client's 5 s timeout
    assert server.billed_count("dropped") == 1 and server.stats["dropped"] == 1
    client.embeddings.create(model=MODEL, input="dropped")  # next one succeeds
    assert server.billed_count("dropped") == 2


def test_drop_marker_every_time(server, client):
    server.drop_marker = "#DROP"
    for _ in range(2):
        with pytest.raises(openai.APIConnectionError):
            client.embeddings.create(model=MODEL, input=["fine", "x #DROP"])
    assert server.billed_count("x #DROP") == 2 and server.billed_count("fine") == 2


def test_wrong_key_is_401(server):
    with make_client(server, key="wrong") as c, pytest.raises(openai.AuthenticationError) as ei:
        c.embeddings.create(model=MODEL, input="a")
    assert ei.value.code == "invalid_api_key"
    assert server.stats["responses_by_status"] == {401: 1}


def test_unknown_model_is_404():
    with FakeOpenAI(models={MODEL}) as srv, make_client(srv) as c:
        c.embeddings.create(model=MODEL, input="a")
        with pytest.raises(openai.NotFoundError) as ei:
            c.embeddings.create(model="no-such-model", input="a")
        assert ei.value.code == "model_not_found"


def test_hold_marker_waits_for_release(server, client):
    """A held request is answered only after release(); others pass; held counts arrivals."""
    server.hold("HOLD")
    answers: list = []
    t = threading.Thread(target=lambda: answers.append(client.embeddings.create(model=MODEL, input="HOLD me")))
    t.start()
    wait_until(lambda: server.held == 1, timeout=60, what="the request to reach the hold")
    client.embeddings.create(model=MODEL, input="not held")  # answered while the other waits
    assert t.is_alive() and not answers
    server.release()
    t.join(60)
    assert not t.is_alive() and len(answers) == 1 and server.billed_count("HOLD me") == 1


def test_slow_marker_times_out_and_stop_is_prompt():
    srv = FakeOpenAI().start()
    srv.slow_marker, srv.slow_seconds = "SLOW", 60.0
    with make_client(srv, timeout=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            c.embeddings.create(model=MODEL, input="very SLOW text")
        assert time.monotonic() - t0 < 30  # the client's timeout, not the 60 s answer
        c.embeddings.create(model=MODEL, input="fast text")  # other requests unaffected
    # stop() while a slow request is in flight
    slow_client = make_client(srv, timeout=120)
    outcome: list[BaseException] = []

    def slow_call() -> None:
        try:
            slow_client.embeddings.create(model=MODEL, input="SLOW")
        except BaseException as e:
            outcome.append(e)

    th = threading.Thread(target=slow_call)
    th.start()
    wait_until(lambda: srv.stats["slow"] >= 2, what="the slow request to be in its sleep")
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 30  # it interrupted the 60 s sleep
    th.join(60)
    assert not th.is_alive() and isinstance(outcome[0], openai.APIConnectionError)
    slow_client.close()


def test_global_latency(server, client):
    server.latency = 0.2
    t0 = time.monotonic()
    client.embeddings.create(model=MODEL, input="a")
    assert 0.19 <= time.monotonic() - t0 < 10  # the latency is applied (the upper bound: a loaded machine)


def test_rpm_limit():
    with FakeOpenAI(rpm=3) as srv, make_client(srv) as c:
        for i in range(3):
            raw = c.embeddings.with_raw_response.create(model=MODEL, input=f"t{i}")
            assert raw.headers["x-ratelimit-remaining-requests"] == str(2 - i)
        with pytest.raises(openai.RateLimitError) as ei:
            c.embeddings.create(model=MODEL, input="t3")
        h = ei.value.response.headers
        assert 0.05 <= float(h["retry-after"]) <= 60 and h["x-ratelimit-limit-requests"] == "3"
        s = srv.stats
        assert s["rate_limited"] == 1 and s["responses_by_status"] == {200: 3, 429: 1}
        assert s["billed_inputs"] == 3 and srv.billed_count("t3") == 0


def test_tpm_limit():
    with FakeOpenAI(tpm=10) as srv, make_client(srv) as c:
        c.embeddings.create(model=MODEL, input="x" * 20)  # 6 tokens
        with pytest.raises(openai.RateLimitError) as ei:
            c.embeddings.create(model=MODEL, input="y" * 20)  # 6 more > 10
        assert ei.value.response.headers["x-ratelimit-limit-tokens"] == "10"
        c.embeddings.create(model=MODEL, input="z")  # 1 token still fits


def test_concurrent_requests(server, client):
    def work(i: int) -> None:
        for j in range(10):
            r = client.embeddings.create(model=MODEL, input=[f"c{i}-{j}", "shared"])
            assert np.allclose(r.data[0].embedding, server.vector_for(f"c{i}-{j}"))

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(work, range(16)))
    s = server.stats
    assert s["requests"] == 160 and s["responses_by_status"] == {200: 160}
    assert server.billed_count("shared") == 160 and s["billed_inputs"] == 320


def test_keep_alive(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    hdrs = {"Authorization": "Bearer test-key", "Content-Type": "application/json"}
    for _ in range(3):
        conn.request("POST", "/v1/embeddings", json.dumps({"model": MODEL, "input": "k"}), hdrs)
        r = conn.getresponse()
        assert r.status == 200 and r.version == 11 and not r.will_close
        r.read()
    conn.close()


def test_stats_and_faults_endpoints_in_thread_mode(server, client):
    post_faults(server.base_url, fail_next={"n": 1, "status": 500})
    with pytest.raises(openai.InternalServerError):
        client.embeddings.create(model=MODEL, input="a")
    assert fetch_stats(server.base_url)["responses_by_status"] == {500: 1}


# ---- process mode ----------------------------------------------------------------------------
def test_process_mode():
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline_assets_tests.fake_openai", "--port", "0", "--dim", "8", "--rpm", "1000"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(10)
        assert line and line[0].startswith("READY "), (line, proc.poll())
        base_url = line[0].split()[1]
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        with make_client(base_url) as c:
            resp = c.embeddings.create(model=MODEL, input=["p", "q"])
            assert np.allclose(resp.data[1].embedding, FakeOpenAI(dim=8).vector_for("q"))
            stats = fetch_stats(base_url)
            assert stats["requests"] == 1 and stats["billed_by_text"] == {"p": 1, "q": 1}
            assert stats["responses_by_status"] == {200: 1}
            state = post_faults(base_url, fail_next={"n": 1, "status": 503, "retry_after": "0.5"}, poison_marker="BAD")
            assert state["fail_next"] == 1 and state["poison_marker"] == "BAD"
            with pytest.raises(openai.InternalServerError) as ei:
                c.embeddings.create(model=MODEL, input="p")
            assert ei.value.response.headers["retry-after"] == "0.5"
            with pytest.raises(openai.BadRequestError):
                c.embeddings.create(model=MODEL, input="BAD")
            post_faults(base_url, drop_next=1)
            with pytest.raises(openai.APIConnectionError):
                c.embeddings.create(model=MODEL, input="d")
            post_faults(base_url, clear=True, reset_stats=True)
            c.embeddings.create(model=MODEL, input="BAD")
            stats = fetch_stats(base_url, brief=True)
            assert stats["requests"] == 1 and "billed_by_text" not in stats
    finally:
        proc.terminate()
        rc = proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()
    assert rc == 0
