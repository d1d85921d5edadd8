"""The tombstone run: documents whose files left the source are tombstoned in a run,
not inside a sensor evaluation (which has a time limit, no retries and no run
history). The source sensor requests ``tombstone_documents`` with the vanished
ids in its run config; the run tombstones those still gone (chunks dropped,
unwanted vectors superseded; ``app.observations.tombstone_gone``), then deletes
their partitions, so a partition disappears from the UI only once its document
is tombstoned. A file back by then is left alone: the sensor requests it as changed.
"""

from pathlib import Path

import dagster as dg

from pipeline_assets.app import observations
from pipeline_assets.defs.assets import PARTITIONS_NAME
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource

TOMBSTONE_JOB_NAME = "tombstone_documents"
TOMBSTONE_OP_NAME = "tombstone_documents_op"


class TombstoneConfig(dg.Config):
    root: str                    # the source root the sensor scanned (absolute)
    document_ids: list[str]      # documents whose files it found gone


@dg.op(name=TOMBSTONE_OP_NAME,
       description="Tombstone the documents whose files are still gone, then delete their partitions.")
def tombstone_documents_op(context: dg.OpExecutionContext, config: TombstoneConfig, postgres: PostgresResource,
                           embedding_provider: EmbeddingProviderResource) -> dg.Output[list]:
    done = observations.tombstone_gone(embedding_provider.runtime(run_id=context.run_id), postgres.pool(),
                                       Path(config.root), config.document_ids)
    existing = set(context.instance.get_dynamic_partitions(PARTITIONS_NAME))
    removed = [k for k in done.document_ids if k in existing]
    for key in removed:
        context.instance.delete_dynamic_partition(PARTITIONS_NAME, key)
    if done.back:
        context.log.info(f"{len(done.back)} file(s) are back and were left alone: {done.back[:5]}")
    return dg.Output(done.document_ids, metadata={
        "tombstoned": done.report.deleted, "superseded_jobs": done.report.superseded,
        "partitions_deleted": len(removed), "back_in_source": len(done.back)})


@dg.job(name=TOMBSTONE_JOB_NAME, executor_def=dg.in_process_executor,
        description="Documents gone from the source: tombstoned, their partitions deleted (requested by "
                    "the source_documents sensor).")
def tombstone_job():
    tombstone_documents_op()


def tombstone_request(root: Path, document_ids: list[str], run_key: str, tags: dict[str, str]) -> dg.RunRequest:
    return dg.RunRequest(
        job_name=TOMBSTONE_JOB_NAME, run_key=run_key, tags=tags,
        run_config={"ops": {TOMBSTONE_OP_NAME: {"config": {"root": str(root),
                                                           "document_ids": list(document_ids)}}}})
