"""The memory of a vector index build: sized to the HNSW graph it builds (a graph builds many times
faster while it fits in ``maintenance_work_mem``), at most the configured cap
(PIPELINE_INDEX_BUILD_MEMORY), never below what the session already has."""

from __future__ import annotations

# Per vector, the element and its neighbour lists (m = 16) plus the vector itself: these bytes
# + 4 per dimension (vector) or 2 (halfvec), as pgvector 0.8 holds them (calibrated by B16, which
# reports the formula against the build's own count: docs/benchmarks.md).
GRAPH_BYTES_PER_VECTOR = 720
VALUE_BYTES_PER_DIMENSION = {"vector": 4, "halfvec": 2}
# Headroom over that estimate (allocation slack, a build's fixed structures).
GRAPH_MEMORY_MARGIN = 1.1
GRAPH_MEMORY_FIXED = 16 * 1024 * 1024


def graph_bytes(vectors: int, dimension: int, kind: str) -> int:
    """The estimated memory of the HNSW graph of ``vectors`` vectors cast to ``kind`` (vector or
    halfvec, ``vector_index.index_kind``), with the margin."""
    per_vector = GRAPH_BYTES_PER_VECTOR + VALUE_BYTES_PER_DIMENSION[kind] * dimension
    return int(vectors * per_vector * GRAPH_MEMORY_MARGIN) + GRAPH_MEMORY_FIXED


def build_memory(vectors: int, dimension: int, kind: str, *, session_memory: int, cap: int) -> int:
    """The maintenance_work_mem of a build, in bytes: the graph's estimate, at most ``cap``,
    never less than the session already has (the server's or the role's setting)."""
    return max(session_memory, min(cap, graph_bytes(vectors, dimension, kind)))
