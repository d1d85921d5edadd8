"""B17 (client choice): listing and reading small objects with obstore and with boto3,
against the same moto server (S3-compatible, 127.0.0.1) holding ``--objects`` objects.

Interleaved, ``--rounds`` times each: a paged listing of every key (1000 a page), and
reading the first ``--reads`` objects 8 at a time (the S3 source's bound). Prints JSON:
the best wall time and the client's own CPU time (this process) of each, and the ratios
boto3 / obstore. The server's time is the same for both; the client's CPU is what the
choice changes (on a shared 2-core machine it is also taken from the server).

    python benchmarks/b17_s3_clients.py [--objects 100000] [--reads 10000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from b17_s3_scan import BUCKET, PREFIX, _free_port, _wait_listening

READS_IN_FLIGHT = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--reads", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import boto3
    import obstore
    from obstore.store import S3Store

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("b17_s3_scan.py")),
            "--serve",
            str(port),
            "--objects",
            str(args.objects),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    result: dict = {"benchmark": "b17_s3_clients", "objects": args.objects, "reads": args.reads}
    try:
        _wait_listening(port, server, timeout=900)
        boto = boto3.client(
            "s3", endpoint_url=url, aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
        )
        store = S3Store(
            BUCKET,
            endpoint=url,
            access_key_id="bench",
            secret_access_key="bench",
            region="us-east-1",
            client_options={"allow_http": True},
        )
        keys = [f"{PREFIX}/d{i:07d}.md" for i in range(min(args.reads, args.objects))]

        def boto_list() -> int:
            pages = boto.get_paginator("list_objects_v2").paginate(
                Bucket=BUCKET, Prefix=f"{PREFIX}/", PaginationConfig={"PageSize": 1000}
            )
            return sum(len(page.get("Contents", [])) for page in pages)

        def obstore_list() -> int:
            return sum(len(page) for page in obstore.list(store, PREFIX, chunk_size=1000))

        def boto_read() -> int:
            with ThreadPoolExecutor(READS_IN_FLIGHT) as pool:
                return sum(pool.map(lambda k: len(boto.get_object(Bucket=BUCKET, Key=k)["Body"].read()), keys))

        def obstore_read() -> int:
            with ThreadPoolExecutor(READS_IN_FLIGHT) as pool:
                return sum(pool.map(lambda k: len(bytes(obstore.get(store, k).bytes())), keys))

        runs = {
            "boto3_list": boto_list,
            "obstore_list": obstore_list,
            "boto3_read": boto_read,
            "obstore_read": obstore_read,
        }
        wall: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                started, cpu_started = time.perf_counter(), time.process_time()
                fn()
                wall[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - cpu_started)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    for name in runs:
        result[f"{name}_s"] = round(min(wall[name]), 3)
        result[f"{name}_client_cpu_s"] = round(min(cpu[name]), 3)
    for op in ("list", "read"):
        result[f"{op}_wall_boto3_over_obstore"] = round(min(wall[f"boto3_{op}"]) / min(wall[f"obstore_{op}"]), 2)
        result[f"{op}_cpu_boto3_over_obstore"] = round(
            min(cpu[f"boto3_{op}"]) / max(min(cpu[f"obstore_{op}"]), 1e-3), 1
        )
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
