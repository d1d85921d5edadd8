"""The asset keys and the asset group, in one place (every domain names them)."""

import dagster as dg

GROUP = "embedding_pipeline"

# The source's files by bucket: an external asset the source sensor observes (a new data
# version per bucket with new, changed or gone files), upstream of documents.
SOURCE_FILES = dg.AssetKey("source_files")
DOCUMENTS = dg.AssetKey("documents")
CHUNKS = dg.AssetKey("chunks")
EMBEDDINGS = dg.AssetKey("embeddings")
# The pipeline's assets, in order: documents and chunks by bucket (the sync_documents job),
# embeddings by bucket x model (the embed_documents job).
ASSET_KEYS = (DOCUMENTS, CHUNKS, EMBEDDINGS)
INGEST_KEYS = (DOCUMENTS, CHUNKS)
# The job table and the vectors search serves: observed and checked, never materialized.
EMBEDDING_STORE = dg.AssetKey("embedding_store")
RECONCILIATION = dg.AssetKey("reconciliation")
