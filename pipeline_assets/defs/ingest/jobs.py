"""``sync_documents``: documents -> chunks over one bucket or a range of buckets."""

import dagster as dg

from pipeline_assets.defs.keys import INGEST_KEYS
from pipeline_assets.defs.run_requests import SYNC_JOB_NAME

SYNC_JOB = dg.define_asset_job(
    SYNC_JOB_NAME,
    selection=dg.AssetSelection.assets(*INGEST_KEYS),
    description="documents -> chunks for one bucket or a range of buckets: each bucket brought current with "
    "the source and the code (unchanged documents are skipped). Its success requests the "
    "embeddings run of the same buckets (sensor embed_after_sync).",
)
