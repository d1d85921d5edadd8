"""The bounds of a vector index build (``registry.vector_index``), named for the configs that carry them."""

from __future__ import annotations

# The most maintenance_work_mem one vector index build may take (a build is sized to its HNSW graph:
# ~1.9 GB for 1M vectors of 256 dimensions; a larger graph builds partly on disk, far slower).
DEFAULT_INDEX_BUILD_MEMORY = 2 * 1024 ** 3
# The least a build may be given.
MIN_INDEX_BUILD_MEMORY = 1 << 20
