"""The model registry's bounds: what one vector index build may take, how long a retired model's
vectors are kept. Named here for the configs and settings that carry them."""

from __future__ import annotations

# The most maintenance_work_mem one vector index build may take (a build is sized to its HNSW graph:
# ~1.9 GB for 1M vectors of 256 dimensions; a larger graph builds partly on disk, far slower).
DEFAULT_INDEX_BUILD_MEMORY = 2 * 1024**3
# The least a build may be given.
MIN_INDEX_BUILD_MEMORY = 1 << 20
# How long a retired model's vectors and vector index are kept after `models retire` (a rollback
# within it is `models activate` + `models serve`, with no re-embedding) before reconcile deletes
# them; bounds the storage a replaced model holds.
DEFAULT_MODEL_RETIRE_GRACE_SECONDS = 7 * 24 * 3600.0
