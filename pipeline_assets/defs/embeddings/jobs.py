"""``embed_documents``: embeddings (and their coverage check) over buckets x models."""

import dagster as dg

from pipeline_assets.defs.keys import EMBEDDINGS
from pipeline_assets.defs.run_requests import EMBED_JOB_NAME

EMBED_JOB = dg.define_asset_job(
    EMBED_JOB_NAME,
    selection=dg.AssetSelection.assets(EMBEDDINGS),
    description="embeddings (and the partition_embedded check) for a rectangle of buckets x models: only "
    "content without a vector for a model is sent.",
)
