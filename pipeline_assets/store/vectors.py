"""A batch of vectors sent as one binary ``vector[]`` parameter, encoded in one numpy pass.

``VectorBatch`` wraps an (n, dim) float32 array; its dumper writes PostgreSQL's binary array of
pgvector's binary ``vector`` elements from one structured numpy array: the bytes pgvector's own
dumper would send element by element (docs/decisions/0006-binary-array-parameters.md).
``db.connect`` and ``db.make_pool`` register it (``register``, after pgvector's); ``param`` falls
back to the plain list on a connection without it or for vectors that are not one (n, dim) array.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.types import TypeInfo

# pgvector's largest vector (VECTOR_MAX_DIM); past it the server refuses the value as before.
MAX_DIMENSION = 16000


class VectorBatch:
    """n vectors of one dimension, as an (n, dim) array."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray) -> None:
        if rows.ndim != 2:
            raise ValueError(f"expected an (n, dim) array, got shape {rows.shape}")
        self.rows = rows


def register(conn: psycopg.Connection) -> None:
    """Register the batch dumper on ``conn`` (after pgvector's ``register_vector``)."""
    info = conn.adapters.types.get("vector")
    if info is not None:
        conn.adapters.register_dumper(VectorBatch, _dumper(info))


def param(conn: psycopg.Connection, vectors: Sequence[Any]) -> VectorBatch | list:
    """``vectors`` as a parameter for ``%b::vector[]``: one ``VectorBatch`` when they
    form one (n, dim) array and ``conn`` has the dumper, else the list as it is."""
    if not vectors or not _registered(conn):
        return list(vectors)
    try:
        rows = np.stack(vectors)
    except ValueError:  # not all of one dimension: let pgvector dump (and the server judge) each
        return list(vectors)
    if rows.ndim != 2 or not 0 < rows.shape[1] <= MAX_DIMENSION or rows.dtype.kind not in "fiu":
        return list(vectors)
    return VectorBatch(rows)


def _registered(conn: psycopg.Connection) -> bool:
    try:
        conn.adapters.get_dumper(VectorBatch, psycopg.adapt.PyFormat.BINARY)
    except psycopg.ProgrammingError:
        return False
    return True


def _dumper(info: TypeInfo) -> type[Dumper]:
    header = struct.Struct(">iiIii")  # ndim, has-nulls flag, element oid; then the dimension's size, lower bound

    class VectorBatchDumper(Dumper):
        format = Format.BINARY
        oid = info.array_oid

        def dump(self, obj: VectorBatch) -> bytes:
            n, dim = obj.rows.shape
            elements = np.empty(
                n, dtype=[("length", ">i4"), ("dim", ">u2"), ("unused", ">u2"), ("values", ">f4", (dim,))]
            )
            elements["length"] = 4 + 4 * dim
            elements["dim"] = dim
            elements["unused"] = 0
            elements["values"] = obj.rows
            return header.pack(1, 0, info.oid, n, 1) + elements.tobytes()

    return VectorBatchDumper
