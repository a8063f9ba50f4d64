"""Arrow arrays of a segment's columns built from numpy buffers, one call per column (``array``).

``pyarrow.array`` imports pandas at its first call whatever it is given (to ask whether the value is a pandas
object): ~0.2-0.3 s of CPU in each archiver process, more than a thousand episodes' move on the default run. These
arrays are the same values, built off their buffers (offsets, bytes, a validity bitmap) with numpy, which also
skips ``pyarrow.array``'s per-value type inference. Types: strings, binaries, integers and floats (None: null), and
lists of them (a list itself is never null).
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import pyarrow as pa

NUMPY = {
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint32(): np.uint32,
    pa.float32(): np.float32,
    pa.float64(): np.float64,
}


def _validity(values: list) -> tuple[pa.Buffer | None, int]:
    """(the validity bitmap, the null count) of ``values`` (None: null); no bitmap without nulls."""
    if None not in values:
        return None, 0
    valid = np.fromiter((v is not None for v in values), np.bool_, len(values))
    return pa.py_buffer(np.packbits(valid, bitorder="little")), len(values) - int(valid.sum())


def offsets(lengths) -> np.ndarray:
    """int32 offsets (n + 1, from 0) of items of these lengths."""
    out = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def _bytes(values: list, kind: pa.DataType) -> pa.Array:
    validity, nulls = _validity(values)
    if kind == pa.string():
        values = [b"" if v is None else v.encode() for v in values]
    elif nulls:
        values = [b"" if v is None else v for v in values]
    lengths = np.fromiter(map(len, values), np.int64, len(values))
    if lengths.sum() >= 1 << 31:
        raise ValueError(
            f"a segment column of {kind} holds {lengths.sum()} bytes: more than 2 GB (fewer episodes per segment)"
        )
    return pa.Array.from_buffers(
        kind, len(values), [validity, pa.py_buffer(offsets(lengths)), pa.py_buffer(b"".join(values))], nulls
    )


def _numbers(values: list, kind: pa.DataType) -> pa.Array:
    validity, nulls = _validity(values)
    if nulls:
        values = [0 if v is None else v for v in values]
    data = np.array(values, NUMPY[kind]) if values else np.zeros(0, NUMPY[kind])
    return pa.Array.from_buffers(kind, len(values), [validity, pa.py_buffer(data)], nulls)


def array(values: list, kind: pa.DataType) -> pa.Array:
    """``pyarrow.array(values, kind)`` for the column types of a segment, without importing pandas."""
    if pa.types.is_list(kind):
        flat = list(chain.from_iterable(values))
        lengths = np.fromiter(map(len, values), np.int64, len(values))
        return pa.ListArray.from_arrays(from_numpy(offsets(lengths), pa.int32()), array(flat, kind.value_type))
    if kind in (pa.string(), pa.binary()):
        return _bytes(values, kind)
    return _numbers(values, kind)


def from_numpy(values: np.ndarray, kind: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    """An array of ``kind`` over a numpy array of its type (``valid``: False where null)."""
    if valid is None or valid.all():
        return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(np.ascontiguousarray(values))], 0)
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(
        kind, len(values), [bitmap, pa.py_buffer(np.ascontiguousarray(values))], len(values) - int(valid.sum())
    )


def valid_values(values: pa.Array) -> np.ndarray:
    """The values of a primitive array that are not null, as numpy (``to_numpy`` imports pandas, ``drop_null``
    pyarrow.compute: each ~0.03-0.2 s of CPU in a process)."""
    kind = NUMPY[values.type]
    bitmap, data = values.buffers()
    out = np.frombuffer(data, kind, len(values), values.offset * np.dtype(kind).itemsize)
    if bitmap is None or not values.null_count:
        return out
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=values.offset + len(values), bitorder="little")
    return out[bits[values.offset :].astype(bool)]
