"""How the fake OpenAI server answers ``POST /v1/embeddings``, in this order (``Answering._embeddings``):
1. sleep ``latency`` (+ ``slow_seconds`` for ``slow_marker`` or ``slow_rate``; stop() aborts it); with
   ``hold_marker``, wait for :meth:`FakeOpenAI.release` (``held`` counts arrivals: tests wait on it);
2. not billed: ``fail_next``'s canned status, then ``random_faults`` (``[[probability, status,
   retry_after or null], ...]``, one draw per request from ``fault_seed``), then ``throttle_marker``
   (429, ``Retry-After: 1``, every time) and ``error_marker`` (503 every time);
3. auth (401), model (404), validation (400), ``poison_marker`` (400 naming the index), not billed;
4. the rpm/tpm sliding 60 s window -> 429 with Retry-After and x-ratelimit-* headers, not billed;
5. vectors computed (NaN for ``nan_marker``) and BILLED; then ``drop_next``/``drop_marker``/``drop_rate``
   cut the connection, ``short_rate`` loses the last embedding, ``omit_marker`` the marked inputs',
   ``bad_index_rate`` repeats one index; ``drip_marker`` sends the answer in pieces. stats
   ``dropped_inputs``, ``short``, ``short_inputs``, ``bad_index``, ``omitted`` count those faults.
"""

from __future__ import annotations

import base64
import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline_assets_tests.fake_openai_wire import (
    ARRIVALS_KEPT,
    DRIP_INTERVAL,
    _err,
    _Handler,
    _hard_close,
    _parse_input,
    _vector,
)

if TYPE_CHECKING:
    pass


class Answering:
    """The answering half of ``FakeOpenAI``: its state (faults, stats, the rate window) is the
    server's own, set up by ``FakeOpenAI.__init__``."""

    # ---- request handling ------------------------------------------------------------------
    def _respond(self, h: _Handler, status: int, obj: Any, headers: dict | None = None) -> None:
        with self._lock:
            by = self._stats["responses_by_status"]
            by[status] = by.get(status, 0) + 1
        h.send_json(status, obj, headers)

    def _take_budget(self, tokens: int) -> tuple[float, dict]:
        """rpm/tpm check over a sliding 60 s window; caller holds the lock.  Returns
        (retry_after, headers); retry_after == 0 means admitted (and recorded in the window)."""
        now, w, rpm, tpm = time.monotonic(), self._window, self.rpm, self.tpm
        while w and w[0][0] <= now - 60:
            self._window_tokens -= w.popleft()[1]
        wait = 0.0
        if rpm is not None and len(w) >= rpm:  # entry w[len-rpm] must expire to make room
            wait = w[len(w) - rpm][0] + 60 - now if rpm > 0 else 60.0
        if tpm is not None and self._window_tokens + tokens > tpm:
            wait = max(wait, 60.0 if tokens > tpm else 0.0)  # too big ever to fit: OpenAI 429s too
            freed = 0
            for ts, t in w if tokens <= tpm else ():  # oldest entries expire first
                freed += t
                if self._window_tokens - freed + tokens <= tpm:
                    wait = max(wait, ts + 60 - now)
                    break
        if wait <= 0:
            w.append((now, tokens))
            self._window_tokens += tokens
        reset = f"{max(0.0, w[0][0] + 60 - now):.3f}s" if w else "0s"
        hdrs: dict = {}
        if rpm is not None:
            hdrs |= {
                "x-ratelimit-limit-requests": rpm,
                "x-ratelimit-reset-requests": reset,
                "x-ratelimit-remaining-requests": max(0, rpm - len(w)),
            }
        if tpm is not None:
            hdrs |= {
                "x-ratelimit-limit-tokens": tpm,
                "x-ratelimit-reset-tokens": reset,
                "x-ratelimit-remaining-tokens": max(0, tpm - self._window_tokens),
            }
        if wait > 0:
            wait = max(wait, 0.05)
            hdrs |= {"retry-after": f"{wait:.3f}", "retry-after-ms": str(int(wait * 1000))}
        return wait, hdrs

    def _draw(self, probability: float) -> bool:
        with self._lock:
            return self._fault_rng.random() < probability

    def _drop(self, h: _Handler, count: bool = True) -> None:
        h.close_connection = True
        if count:
            with self._lock:
                self._stats["dropped"] += 1
        _hard_close(h.connection, close=False)  # socketserver closes it right after (-> RST)

    def _embeddings(self, h: _Handler, raw: bytes) -> None:
        def reject(status: int, msg: str, code: str | None = None, param: str | None = None) -> None:
            self._respond(h, status, _err(msg, "invalid_request_error", code, param))

        with self._lock:
            self._stats["requests"] += 1
            arrivals = self._stats["arrivals"]
            arrivals.append(time.time())
            del arrivals[:-ARRIVALS_KEPT]
        try:
            req = json.loads(raw or b"null")
        except ValueError:
            req = None
        if not isinstance(req, dict):
            return reject(400, "We could not parse the JSON body of your request.")
        items, input_err = _parse_input(req.get("input"), self.count)
        texts = [t for _, t, _ in items if t is not None]  # string inputs (markers live there)
        has = lambda marker: bool(marker) and any(marker in t for t in texts)  # noqa: E731
        # 1. latency (global + slow marker); stop() interrupts the sleep and drops the request
        slow = has(self.slow_marker) or (self.slow_rate > 0 and self._draw(self.slow_rate))
        if slow:
            with self._lock:
                self._stats["slow"] += 1
        delay = (self.latency or 0.0) + (self.slow_seconds if slow else 0.0)
        if delay > 0 and self._stopping.wait(delay):
            return self._drop(h, count=False)
        if has(self.hold_marker):
            with self._lock:
                self._held += 1
            while not self._released.wait(0.05):
                if self._stopping.is_set():
                    return self._drop(h, count=False)
        # 2. one-shot canned failures
        with self._lock:
            fail = self._fail_spec if self._fail_n > 0 else None
            self._fail_n -= fail is not None
            if fail is None and self.random_faults:
                draw = self._fault_rng.random()
                for probability, status, retry_after in self.random_faults:
                    if draw < probability:
                        fail = (int(status), retry_after, None)
                        break
                    draw -= probability
        if fail is None and has(self.throttle_marker):  # a request the provider never accepts
            fail = (429, "1", None)
        if fail is None and has(self.error_marker):  # one the provider always fails, answering others
            fail = (503, None, None)
        if fail:
            status, retry_after, body = fail
            return self._respond(
                h,
                status,
                body
                if body is not None
                else _err(
                    f"Injected failure (HTTP {status})",
                    "requests" if status == 429 else "server_error",
                    "rate_limit_exceeded" if status == 429 else None,
                ),
                {"retry-after": retry_after} if retry_after is not None else None,
            )
        # 3. auth, model, request validation, poison
        auth = h.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or (self.api_key is not None and auth[7:] != self.api_key):
            return reject(401, "Incorrect API key provided.", "invalid_api_key")
        model = req.get("model")
        if not isinstance(model, str) or not model:
            return reject(400, "You must provide a model parameter.", param="model")
        if self.models is not None and model not in self.models:
            return reject(
                404, f"The model `{model}` does not exist or you do not have access to it.", "model_not_found"
            )
        if input_err:
            return reject(400, input_err, param="input")
        dim, fmt = req.get("dimensions") or self.dim, req.get("encoding_format") or "float"
        if not isinstance(dim, int) or dim < 1 or fmt not in ("float", "base64"):
            return reject(400, f"Invalid dimensions={dim!r} or encoding_format={fmt!r}.")
        poison = self.poison_marker
        for i, (_, text, _) in enumerate(items):
            if poison and text is not None and poison in text:
                return reject(400, f"Invalid input at index {i}: '$.input[{i}]' is invalid.", param=f"input[{i}]")
        # 4. rate limits (429s are not billed and do not consume budget)
        tokens = sum(t for _, _, t in items)
        wait, rl_headers = 0.0, None
        if self.rpm is not None or self.tpm is not None:
            with self._lock:
                wait, rl_headers = self._take_budget(tokens)
                self._stats["rate_limited"] += wait > 0
        if wait > 0:
            return self._respond(
                h,
                429,
                _err(
                    f"Rate limit reached for {model}. Please try again in {wait:.3f}s.",
                    "requests",
                    "rate_limit_exceeded",
                ),
                rl_headers,
            )
        # 5. compute + bill, then either drop the connection or answer
        vecs = [_vector(key, dim) for key, _, _ in items]
        if self.nan_marker:  # a provider bug: NaN vectors for the inputs containing nan_marker
            vecs = [
                np.full(dim, np.nan, "<f4") if t is not None and self.nan_marker in t else v
                for (_, t, _), v in zip(items, vecs)
            ]
        with self._lock:
            s = self._stats
            s["billed_inputs"] += len(items)
            s["billed_tokens"] += tokens
            for key, _, _ in items:
                s["billed_by_text"][key] = s["billed_by_text"].get(key, 0) + 1
            drop = (
                self._drop_n > 0
                or has(self.drop_marker)
                or (self.drop_rate > 0 and self._fault_rng.random() < self.drop_rate)
            )
            self._drop_n -= self._drop_n > 0
            s["dropped_inputs"] += len(items) if drop else 0
            short = not drop and self.short_rate > 0 and self._fault_rng.random() < self.short_rate
            s["short"] += short
            s["short_inputs"] += len(items) if short else 0
            bad_index = (
                not drop and not short and self.bad_index_rate > 0 and self._fault_rng.random() < self.bad_index_rate
            )
            s["bad_index"] += bad_index
        if drop:  # billed, no response: the SDK raises openai.APIConnectionError
            return self._drop(h)
        enc = (lambda v: base64.b64encode(v.tobytes()).decode("ascii")) if fmt == "base64" else np.ndarray.tolist
        data = [{"object": "embedding", "index": i, "embedding": enc(v)} for i, v in enumerate(vecs)]
        if short:  # the last embedding lost on the way (the indexes of the others are intact)
            data.pop()
        if self.omit_marker:  # a proxy that filters out one input's embedding
            kept = [d for d, (_, t, _) in zip(data, items) if t is None or self.omit_marker not in t]
            with self._lock:
                self._stats["omitted"] += len(data) - len(kept)
            data = kept
        if bad_index:  # the right count, but one index twice and one missing (one input: out of range)
            data[-1]["index"] = len(data) - 2 if len(data) > 1 else 1
        answer = {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        if has(self.drip_marker):  # a piece every DRIP_INTERVAL over drip_seconds
            return self._drip(h, json.dumps(answer).encode())
        self._respond(h, 200, answer, rl_headers)

    def _drip(self, h: _Handler, body: bytes) -> None:
        """A valid 200 answer sent a piece every DRIP_INTERVAL over ``drip_seconds`` (padded with
        leading JSON whitespace): every read gets data in time, the whole takes drip_seconds."""
        ticks = max(1, int(self.drip_seconds / DRIP_INTERVAL))
        body = b" " * max(0, ticks - len(body)) + body
        step = -(-len(body) // ticks)
        h.close_connection = True
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.flush()
            for i in range(0, len(body), step):
                if self._stopping.wait(DRIP_INTERVAL):
                    return self._drop(h, count=False)
                h.wfile.write(body[i : i + step])
                h.wfile.flush()
        except OSError:  # the client gave up
            return
        with self._lock:
            by = self._stats["responses_by_status"]
            by[200] = by.get(200, 0) + 1
