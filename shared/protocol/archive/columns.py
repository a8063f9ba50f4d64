"""Columnar token storage for segment rows (format 2): a ``tokens`` entry's ids and log-probs leave its msgpack
``data`` for two per-episode columns, each split into byte planes (all first bytes, then all second bytes, ...,
as shared/protocol/weights/delta.py does for floats), so zstd sees the near-constant high bytes of token ids and
the sign/exponent bytes of log-probs together. Lossless: an entry is moved only when re-packing its ids and
log-probs gives back its ``data`` byte for byte; any other entry stays as it was (``counts`` says -1 for it).

    counts[k]  tokens of entry k moved to the columns, or -1 (entry k's fields kept whole)
    ids        byte planes of the moved entries' token ids, "<u4", in entry order
    logprobs   byte planes of their log-probs, "<f4" (every bit kept)
"""

from __future__ import annotations

import msgpack
import numpy as np
import pyarrow as pa

KEPT = -1


def split_planes(raw: bytes, width: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(-1, width).T.tobytes()


def planes_pay_off(raw: bytes, width: int = 4, level: int = 3) -> bool:
    """Whether zstd stores ``raw`` (values of ``width`` bytes) smaller split into byte planes than as it is: planes
    win where values share their high bytes but rarely repeat whole (random log-probs); plain wins where whole values
    repeat (the episodes of a group that drew the same first tokens have the same log-probs for them, a match zstd
    finds only in plain bytes). Decided per segment on a quick zstd pass (``level``; the file is written at 15)."""
    if not raw:
        return True
    codec = pa.Codec("zstd", compression_level=level)
    return len(codec.compress(split_planes(raw, width))) < len(codec.compress(raw))


def join_planes(raw: bytes, width: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(width, -1).T.tobytes()


def _bin(data: bytes, at: int) -> tuple[int, int] | None:
    """(length, start) of the msgpack bin at ``data[at]`` when its header is the one ``packb`` writes (the shortest)."""
    tag = data[at : at + 1]
    if tag == b"\xc4":
        return (data[at + 1], at + 2) if len(data) > at + 1 else None
    if tag == b"\xc5":
        n = int.from_bytes(data[at + 1 : at + 3], "big")
        return (n, at + 3) if n >= 1 << 8 else None
    if tag == b"\xc6":
        n = int.from_bytes(data[at + 1 : at + 5], "big")
        return (n, at + 5) if n >= 1 << 16 else None
    return None


def token_payload(data: bytes) -> tuple[bytes, bytes] | None:
    """(ids, log-probs) of a payload that is exactly ``packb({"ids": ids, "logprobs": lps}, use_bin_type=True)``
    with ``len(ids) == len(lps)``, a multiple of 4; else None. Read off the bytes (no unpack, no re-pack): the same
    answer as re-packing and comparing, at a fraction of the cost."""
    if data[:5] != b"\x82\xa3ids":
        return None
    head = _bin(data, 5)
    if head is None:
        return None
    n, at = head
    ids, at = data[at : at + n], at + n
    if len(ids) != n or n % 4 or data[at : at + 9] != b"\xa8logprobs":
        return None
    head = _bin(data, at + 9)
    if head is None or head[0] != n or head[1] + n != len(data):
        return None
    return ids, data[head[1] :]


def movable(flat: list[bytes]) -> tuple[bytes, bytes] | None:
    """(ids bytes, log-prob bytes) of a tokens entry whose last field is data = exactly {ids, logprobs}; else None."""
    fields = dict(zip(flat[::2], flat[1::2]))
    if fields.get(b"type") != b"tokens" or len(flat) < 2 or flat[-2] != b"data" or flat.count(b"data") != 1:
        return None
    return token_payload(fields[b"data"])


def pack(flat_entries: list[list[bytes]]) -> tuple[list[list[bytes]], list[int], bytes, bytes]:
    """Flat entries (name/value bytes alternating) -> (entries with moved data emptied, counts, ids, logprobs)."""
    out, counts, ids, lps = [], [], [], []
    for flat in flat_entries:
        moved = movable(flat)
        if moved is None:
            out.append(flat)
            counts.append(KEPT)
            continue
        out.append(flat[:-2])
        counts.append(len(moved[0]) // 4)
        ids.append(moved[0])
        lps.append(moved[1])
    return out, counts, split_planes(b"".join(ids), 4), split_planes(b"".join(lps), 4)


def unpack(entries: list[list[bytes]], counts: list[int], ids: bytes, lps: bytes) -> list[list[bytes]]:
    """The inverse of ``pack``: each moved entry's ``data`` put back where it was (the last field)."""
    ids, lps = join_planes(ids, 4), join_planes(lps, 4)
    out, at = [], 0
    for flat, n in zip(entries, counts):
        if n == KEPT:
            out.append(flat)
            continue
        end = at + 4 * n
        data = msgpack.packb({"ids": ids[at:end], "logprobs": lps[at:end]}, use_bin_type=True)
        out.append([*flat, b"data", data])
        at = end
    return out
