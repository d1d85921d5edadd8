"""B8: the source sensor (`source_documents`) over 100,000 small files.

Evaluates the real sensor as the daemon does (``build_sensor_context``, the project's resources, a
Dagster instance on local storage, a fresh pipeline database): ``first_tick_s`` (every file stored,
one run requested); ``unchanged_tick_s`` (definitions built afresh, as after a code reload, the files
marked synced as that run would; median of 3; ``files_read`` must be 0); ``changed_tick_s`` (one file
rewritten: one read, one run); the cursor's size; ``before``: the sensor of commit a050b3a (checksums
in the cursor, an in-process cache) on the same tree, cold and warm (unless ``--skip-before``).

    python benchmarks/b8_source_sensor.py [--documents 100000] [--skip-before]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
from _common import REPO, Timer, emit, fresh_database, peak_rss_mb
from dagster._core.definitions.partitions.context import partition_loading_context

BEFORE_COMMIT = "a050b3a"  # the last tree with the map cursor
TICK_LIMIT_S = 60.0  # Dagster's default sensor evaluation timeout


def write_corpus(root: Path, n: int) -> None:
    for i in range(n):
        folder = root / f"{i // 1000:03d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        (folder / f"doc-{i:06d}.md").write_text(f"# Document {i}\n\nsmall body {i * 7919 % 100003}\n")
    past = time.time_ns() - 3600 * 10**9  # written an hour ago: outside the racy-mtime window
    for folder in root.iterdir():
        for p in folder.iterdir():
            os.utime(p, ns=(past, past))


def evaluate(sensor, instance, cursor):
    """One tick as the daemon runs it (fresh definitions and resources), partition requests applied."""
    from pipeline_assets.defs.definitions import build_definitions
    from pipeline_assets.defs.resources import build_resources
    from pipeline_assets.settings import Settings

    settings = Settings.from_env()
    defs = build_definitions(settings)
    with (
        dg.build_sensor_context(
            instance=instance, cursor=cursor, definitions=defs, resources=build_resources(settings)
        ) as context,
        partition_loading_context(dynamic_partitions_store=instance),
    ):
        started = time.perf_counter()
        data = sensor.evaluate_tick(context)
        seconds = time.perf_counter() - started
    for request in data.dynamic_partitions_requests or []:
        if isinstance(request, dg.AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return data, seconds


def old_sensor_module():
    """The source sensor of BEFORE_COMMIT, loaded from git as a module of its own."""
    text = subprocess.run(
        ["git", "show", f"{BEFORE_COMMIT}:pipeline_assets/defs/sensors.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "old_sensors.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_sensors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--skip-before", action="store_true", help="do not measure the old sensor")
    args = parser.parse_args()

    from pipeline_assets.content import folder_source
    from pipeline_assets.defs.ingest import source_sensor as sensors
    from pipeline_assets.store import bucket_rows, db

    reads: list[str] = []
    real_checksum = folder_source.file_checksum

    def counting(item, max_bytes):
        reads.append(item.document_id)
        return real_checksum(item, max_bytes)

    folder_source.file_checksum = counting
    result: dict = {"benchmark": "b8_source_sensor", "documents": args.documents, "tick_limit_s": TICK_LIMIT_S}
    with tempfile.TemporaryDirectory(prefix="b8_") as tmp, fresh_database("b8") as url:
        root = Path(tmp) / "corpus"
        with Timer() as t:
            write_corpus(root, args.documents)
        result["write_corpus_s"] = round(t.seconds, 1)
        os.environ.update(
            {"PIPELINE_DATABASE_URL": url, "PIPELINE_SOURCE_DIR": str(root), "PIPELINE_HOME": str(Path(tmp) / "home")}
        )
        (Path(tmp) / "dagster").mkdir()
        with dg.instance_for_test(temp_dir=str(Path(tmp) / "dagster")) as instance:
            data, first = evaluate(sensors.source_documents_sensor, instance, None)
            result["first_tick_s"] = round(first, 2)
            result["first_tick_files_read"] = len(reads)
            result["first_tick_runs"] = len(data.run_requests)
            result["first_tick_run_keys"] = [r.run_key for r in data.run_requests]
            cursor = data.cursor
            with db.session(url) as conn:
                checksums = dict(conn.execute("SELECT document_id, checksum FROM app.source_observations"))
                # B8 launches no run: the files are marked synced as the requested run would mark them,
                # so the next ticks are a corpus at rest, not a million files whose run never ended.
                bucket_rows.mark_synced(conn, str(root.resolve()), checksums)

            unchanged, read_counts = [], []
            for _ in range(3):
                reads.clear()
                data, seconds = evaluate(sensors.source_documents_sensor, instance, cursor)
                assert not data.run_requests, data.run_requests
                unchanged.append(seconds)
                read_counts.append(len(reads))
            result["unchanged_tick_s"] = round(statistics.median(unchanged), 2)
            result["unchanged_tick_rounds_s"] = [round(s, 2) for s in unchanged]
            result["unchanged_tick_files_read"] = max(read_counts)
            result["unchanged_tick_skip_message"] = data.skip_message

            middle = args.documents // 2
            changed = f"{middle // 1000:03d}/doc-{middle:06d}.md"
            (root / changed).write_text("a new body\n")
            reads.clear()
            data, seconds = evaluate(sensors.source_documents_sensor, instance, cursor)
            result["changed_tick_s"] = round(seconds, 2)
            result["changed_tick_files_read"] = len(reads)
            result["changed_tick_runs"] = [r.run_key for r in data.run_requests]
            with db.session(url) as conn:
                checksums[changed] = conn.execute(
                    "SELECT checksum FROM app.source_observations WHERE document_id = %s", (changed,)
                ).fetchone()[0]

            legacy = json.dumps({"v": 1, "g": 1, "d": checksums}, separators=(",", ":"), sort_keys=True)
            result["cursor_bytes"] = {"after": len(cursor.encode()), "before_map": len(legacy.encode())}

            if not args.skip_before:
                try:
                    old = old_sensor_module()
                    old_data, cold = evaluate(old.source_documents_sensor, instance, legacy)
                    _, warm = evaluate(old.source_documents_sensor, instance, legacy)
                    result["before"] = {
                        "commit": BEFORE_COMMIT,
                        "unchanged_tick_cold_cache_s": round(cold, 2),
                        "unchanged_tick_warm_cache_s": round(warm, 2),
                        "skip_message": old_data.skip_message,
                    }
                except Exception as exc:  # the old tree no longer loads against this one
                    result["before"] = {"commit": BEFORE_COMMIT, "error": f"{type(exc).__name__}: {exc}"[:300]}
    result["peak_rss_mb"] = peak_rss_mb()
    result["targets"] = {
        "unchanged_tick_reads_no_file": result["unchanged_tick_files_read"] == 0,
        "unchanged_tick_within_10pct_of_limit": result["unchanged_tick_s"] <= TICK_LIMIT_S / 10,
        "cursor_under_100_bytes": result["cursor_bytes"]["after"] < 100,
    }
    emit(result)


if __name__ == "__main__":
    sys.exit(main())
