"""B17: the S3 source's unchanged scan against a plain paged listing, same client, same bucket.

A moto server (``moto[server]``, on 127.0.0.1) child process holds ``--objects`` small objects (put
into its store before it serves). Interleaved, ``--rounds`` times: ``listing``, a paged listing of the
prefix with the source's client (obstore, 1000 keys a page: the floor any scan pays), and ``scan``,
the source sensor's scan of the same unchanged prefix (``observations.scan`` over ``S3Source``, after
a first scan recorded every object). Prints JSON: the best time of each, ``ratio = listing / scan``
(target >= 0.7) and the objects the server served a GET of during the unchanged scans (must be 0).

    python benchmarks/b17_s3_scan.py [--objects 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Timer, fresh_database, settle

BUCKET = "bench-corpus"
PREFIX = "docs"
TARGET_RATIO = 0.7


def serve(port: int, objects: int) -> None:
    """The child: fill moto's store, then serve it on 127.0.0.1:port."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import FakeKey, s3_backends
    from moto.server import main

    bucket = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(BUCKET, "us-east-1")
    for i in range(objects):  # the store's own objects, without a request (or an event) per object
        key = FakeKey(
            f"{PREFIX}/d{i:07d}.md",
            f"document {i}: some words of text".encode(),
            account_id=DEFAULT_ACCOUNT_ID,
            region_name="us-east-1",
        )
        bucket.keys[key.name] = key
    main(["-H", "127.0.0.1", "-p", str(port)])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("moto server exited")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"moto server not listening after {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.objects)
        return

    import obstore

    from pipeline_assets.app import observations
    from pipeline_assets.app.source_registry import open_source
    from pipeline_assets.settings import Settings
    from pipeline_assets.store import db

    port = _free_port()
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_REGION": "us-east-1",
        }
    )
    result: dict = {"benchmark": "b17_s3_scan", "objects": args.objects, "target_ratio": TARGET_RATIO}
    with tempfile.TemporaryDirectory(prefix="b17_") as tmp, fresh_database("b17") as url:
        log = open(Path(tmp) / "moto.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(port), "--objects", str(args.objects)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            with Timer() as t:
                _wait_listening(port, proc, timeout=600)
            result["server_fill_s"] = round(t.seconds, 2)
            source = open_source(f"s3://{BUCKET}/{PREFIX}", Settings.from_env().source_config())
            store = source.store  # type: ignore[attr-defined]

            def listing() -> int:
                return sum(len(page) for page in obstore.list(store, PREFIX, chunk_size=1000))

            conn = db.connect(url)
            with Timer() as t:
                first = observations.scan(conn, source, max_bytes=1 << 20)
            assert first.present == args.objects, first
            result["first_scan_s"] = round(t.seconds, 2)
            log.flush()
            gets_before = _object_gets(Path(tmp) / "moto.log")
            times: dict[str, list[float]] = {"listing": [], "scan": []}
            for _ in range(args.rounds):
                settle(url)
                with Timer() as t:
                    assert listing() == args.objects
                times["listing"].append(t.seconds)
                settle(url)
                with Timer() as t:
                    again = observations.scan(conn, source, max_bytes=1 << 20)
                assert (again.present, again.written, again.gone) == (args.objects, 0, 0), again
                times["scan"].append(t.seconds)
            log.flush()
            result["objects_downloaded_by_unchanged_scans"] = _object_gets(Path(tmp) / "moto.log") - gets_before
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()
    best = {k: min(v) for k, v in times.items()}
    result.update({f"{k}_s": round(v, 3) for k, v in best.items()})
    result["all_s"] = {k: [round(x, 3) for x in v] for k, v in times.items()}
    result["ratio"] = round(best["listing"] / best["scan"], 3)
    result["meets_target"] = result["ratio"] >= TARGET_RATIO and result["objects_downloaded_by_unchanged_scans"] == 0
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=2))


def _object_gets(log: Path) -> int:
    """GET requests of an object (not a listing) in the server's request log."""
    pattern = re.compile(rf'"GET /{BUCKET}/[^ ?]+ HTTP')
    return sum(1 for line in log.read_text(errors="replace").splitlines() if pattern.search(line))


if __name__ == "__main__":
    main()
