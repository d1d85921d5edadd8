"""B9: materializing one `embeddings` partition while a large backlog waits.

A backlog of other documents is ingested (jobs pending, never embedded), then
one partition of a separate source is materialized through Dagster
(`sync_documents` then `embed_documents`, in-process executor, ephemeral instance, the offline
local provider). Reported: the run's wall time, the inputs it sent (from the
spend ledger) against its own chunk count, the backlog left pending; and, as
the "before" baseline, the time a worker takes to drain the whole queue
(what an embeddings run would wait for if it drained the queue).

    python benchmarks/b9_partition_backlog.py [--backlog-documents 2000] [--words 1500]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import dagster as dg
from _common import emit, fresh_database

from pipeline_assets.app.embed import work
from pipeline_assets.app.ingest import ingest_source
from pipeline_assets.defs.definitions import build_definitions
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.settings import Settings
from pipeline_assets.store import db


def write_docs(root: Path, prefix: str, n: int, words: int) -> None:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"{prefix}{i:05d}.md").write_text(" ".join(f"{prefix}{i}x{j}" for j in range(words)) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backlog-documents", type=int, default=2000)
    p.add_argument("--words", type=int, default=1500, help="words per backlog document (~15 chunks at 1,500)")
    args = p.parse_args()
    for name in [k for k in os.environ if k.startswith("OPENAI_")] + ["PIPELINE_EMBEDDING_MODEL"]:
        os.environ.pop(name, None)  # the offline local provider
    with fresh_database("b9") as url, tempfile.TemporaryDirectory(prefix="b9-") as tmp:
        os.environ["PIPELINE_DATABASE_URL"] = url
        source, backlog = Path(tmp) / "source", Path(tmp) / "backlog"
        write_docs(source, "own", 1, 400)
        write_docs(backlog, "b", args.backlog_documents, args.words)
        os.environ["PIPELINE_SOURCE_DIR"] = str(source)
        settings = Settings.from_env()
        with dg.build_resources(build_resources(settings)) as res:
            rt, pool = res.embedding_provider.runtime(), res.postgres.pool()
            started = time.perf_counter()
            ingest_source(rt, pool, backlog)
            ingest_seconds = time.perf_counter() - started
        with db.connect(url) as conn:
            pending = conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'pending'").fetchone()[0]

        defs = build_definitions(settings)
        instance = dg.DagsterInstance.ephemeral()
        from pipeline_assets.app.buckets import bucket_of
        from pipeline_assets.defs.partitions import MODEL_PARTITIONS_NAME, bucket_key, embedding_key
        from pipeline_assets.providers import model_id_for

        bucket = bucket_key(bucket_of("own00000.md", settings.partition_buckets))
        model = model_id_for(settings.provider_config())
        instance.add_dynamic_partitions(MODEL_PARTITIONS_NAME, [model])
        started = time.perf_counter()
        # The bucket run, then the embeddings run of that bucket x the model (what embed_after_sync launches).
        result = defs.resolve_job_def("sync_documents").execute_in_process(
            instance=instance, partition_key=bucket, raise_on_error=False
        )
        if result.success:
            result = defs.resolve_job_def("embed_documents").execute_in_process(
                instance=instance, partition_key=str(embedding_key(bucket, model)), raise_on_error=False
            )
        run_seconds = time.perf_counter() - started
        with db.connect(url) as conn:
            own = conn.execute(
                "SELECT count(*) FROM app.chunks c JOIN app.documents d USING (doc_pk) "
                "WHERE d.document_id = 'own00000.md'"
            ).fetchone()[0]
            sent = conn.execute("SELECT count(*) FROM app.input_sends").fetchone()[0]
            left = conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'pending'").fetchone()[0]

        with dg.build_resources(build_resources(settings)) as res:
            started = time.perf_counter()
            drained = work(res.embedding_provider.runtime(), res.postgres.pool(), until_idle=True)
            drain_seconds = time.perf_counter() - started
    emit(
        {
            "benchmark": "b9_partition_backlog",
            "backlog_jobs_pending": pending,
            "backlog_ingest_seconds": round(ingest_seconds, 2),
            "one_partition": {
                "success": result.success,
                "seconds": round(run_seconds, 2),
                "own_chunks": own,
                "inputs_sent": sent,
                "backlog_left_pending": left,
            },
            "before_baseline_drain_whole_queue": {"seconds": round(drain_seconds, 2), "embedded": drained.embedded},
            "targets": {"sent_only_its_own_chunks": sent == own, "backlog_untouched": left == pending},
        }
    )


if __name__ == "__main__":
    main()
