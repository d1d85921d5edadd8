"""The openai SDK alone (b1_cli_sdk's ceiling): every text sent once, ``threads`` threads,
``batch`` texts per request, max_retries=0, the SDK's default parsing of the answer.

Imports nothing but the SDK and the standard library, so that run as a script

    python benchmarks/_sdk_alone.py TEXTS_FILE BASE_URL THREADS BATCH DIM

its wall time is the SDK's own end to end (interpreter, `import openai`, client, sends, exit).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path

import openai

MODEL = "bench-embed"
KEY = "bench-key"  # the fake's key (a local stand-in, never a real credential)
TIMEOUT_SECONDS = 30


def sdk_alone(base_url: str, texts: list[str], *, threads: int, batch: int, dim: int) -> float:
    """Seconds for the SDK alone to send every text once, ``threads`` threads, ``batch`` per request."""
    work: queue.Queue = queue.Queue()
    for i in range(0, len(texts), batch):
        work.put(texts[i : i + batch])
    client = openai.OpenAI(api_key=KEY, base_url=base_url, max_retries=0, timeout=TIMEOUT_SECONDS)
    got = [0] * threads

    def loop(k: int) -> None:
        while True:
            try:
                chunk = work.get_nowait()
            except queue.Empty:
                return
            resp = client.embeddings.create(model=MODEL, input=chunk, dimensions=dim)
            got[k] += len(resp.data)

    started = time.perf_counter()
    pool = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - started
    assert sum(got) == len(texts), (sum(got), len(texts))
    client.close()
    return seconds


if __name__ == "__main__":
    texts_file, base_url, threads, batch, dim = sys.argv[1:6]
    sdk_alone(base_url, Path(texts_file).read_text().splitlines(), threads=int(threads), batch=int(batch), dim=int(dim))
