"""The asset keys, in one place (the assets, checks, sensors and the model switch name them)."""

import dagster as dg

DOCUMENTS = dg.AssetKey("documents")
CHUNKS = dg.AssetKey("chunks")
EMBEDDINGS = dg.AssetKey("embeddings")
# What the embed_documents job materializes, in order.
ASSET_KEYS = (DOCUMENTS, CHUNKS, EMBEDDINGS)
# The job table and the vectors search serves: observed and checked, never materialized.
EMBEDDING_STORE = dg.AssetKey("embedding_store")
