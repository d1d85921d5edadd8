"""Job ids and checksums as one binary array parameter, encoded in one pass.

``Int8Array`` and ``ByteaArray`` wrap a sequence; their dumpers write PostgreSQL's binary array
format (one dimension, no nulls) in one numpy pass or one ``join``: the bytes psycopg's list dumper
would send, without its per-element cost under the GIL (docs/decisions/0006-binary-array-parameters.md).
``db.connect`` and ``db.make_pool`` register them on every connection (``register``); ``int8`` and
``bytea`` fall back to the plain list without them. They are registered for their Python class only,
so a COPY with ``set_types(["bigint[]"])`` still gets psycopg's own list dumper.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import psycopg
from psycopg.abc import AdaptContext
from psycopg.adapt import Dumper, PyFormat
from psycopg.pq import Format

INT8_OID, INT8_ARRAY_OID = 20, 1016
BYTEA_OID, BYTEA_ARRAY_OID = 17, 1001

_HEADER = struct.Struct(">iiIii")  # ndim, has-nulls flag, element oid; then the dimension's size, lower bound
_EMPTY = struct.Struct(">iiI")  # ndim 0: no dimension follows
_LENGTH = struct.Struct(">i")


class Int8Array:
    """A sequence of ints sent as one binary ``bigint[]``."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[int]) -> None:
        self.values = values


class ByteaArray:
    """A sequence of bytes values sent as one binary ``bytea[]``."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[bytes]) -> None:
        self.values = values


class _ArrayDumper(Dumper):
    format = Format.BINARY
    array_oid = 0

    def __init__(self, cls: type, context: AdaptContext | None = None) -> None:
        super().__init__(cls, context)
        self.oid = self.array_oid  # per instance: not registered as the dumper of the oid (COPY keeps psycopg's)


class _Int8ArrayDumper(_ArrayDumper):
    array_oid = INT8_ARRAY_OID

    def dump(self, obj: Int8Array) -> bytes:
        n = len(obj.values)
        if not n:
            return _EMPTY.pack(0, 0, INT8_OID)
        elements = np.empty(n, dtype=[("length", ">i4"), ("value", ">i8")])
        elements["length"] = 8
        elements["value"] = obj.values
        return _HEADER.pack(1, 0, INT8_OID, n, 1) + elements.tobytes()


class _ByteaArrayDumper(_ArrayDumper):
    array_oid = BYTEA_ARRAY_OID

    def dump(self, obj: ByteaArray) -> bytes:
        n = len(obj.values)
        if not n:
            return _EMPTY.pack(0, 0, BYTEA_OID)
        parts = [_HEADER.pack(1, 0, BYTEA_OID, n, 1)]
        for value in obj.values:
            parts.append(_LENGTH.pack(len(value)))
            parts.append(bytes(value))
        return b"".join(parts)


def register(conn: psycopg.Connection) -> None:
    """Register the array dumpers on ``conn``."""
    conn.adapters.register_dumper(Int8Array, _Int8ArrayDumper)
    conn.adapters.register_dumper(ByteaArray, _ByteaArrayDumper)


def int8(conn: psycopg.Connection, values: Sequence[int]) -> Int8Array | list[int]:
    """``values`` as a ``bigint[]`` parameter: one ``Int8Array`` when ``conn`` has the dumper."""
    return Int8Array(values) if _registered(conn, Int8Array) else list(values)


def bytea(conn: psycopg.Connection, values: Sequence[bytes]) -> ByteaArray | list[bytes]:
    """``values`` as a ``bytea[]`` parameter: one ``ByteaArray`` when ``conn`` has the dumper."""
    return ByteaArray(values) if _registered(conn, ByteaArray) else list(values)


def _registered(conn: psycopg.Connection, cls: type) -> bool:
    try:
        conn.adapters.get_dumper(cls, PyFormat.BINARY)
    except psycopg.ProgrammingError:
        return False
    return True
