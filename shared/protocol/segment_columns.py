"""Columnar token storage for segment rows (format 2): a ``tokens`` entry's ids and log-probs leave its msgpack
``data`` for two per-episode columns, each split into byte planes (all first bytes, then all second bytes, ...,
as shared/protocol/weight_delta.py does for floats), so zstd sees the near-constant high bytes of token ids and
the sign/exponent bytes of log-probs together. Lossless: an entry is moved only when re-packing its ids and
log-probs gives back its ``data`` byte for byte; any other entry stays as it was (``counts`` says -1 for it).

    counts[k]  tokens of entry k moved to the columns, or -1 (entry k's fields kept whole)
    ids        byte planes of the moved entries' token ids, "<u4", in entry order
    logprobs   byte planes of their log-probs, "<f4" (every bit kept)
"""

from __future__ import annotations

import msgpack
import numpy as np

KEPT = -1


def split_planes(raw: bytes, width: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(-1, width).T.tobytes()


def join_planes(raw: bytes, width: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(width, -1).T.tobytes()


def movable(flat: list[bytes]) -> tuple[bytes, bytes] | None:
    """(ids bytes, log-prob bytes) of a tokens entry whose last field is data = exactly {ids, logprobs}; else None."""
    fields = dict(zip(flat[::2], flat[1::2]))
    if fields.get(b"type") != b"tokens" or len(flat) < 2 or flat[-2] != b"data" or flat.count(b"data") != 1:
        return None
    try:
        data = msgpack.unpackb(fields[b"data"], raw=False)
    except Exception:  # noqa: BLE001 - an undecodable payload is simply kept as it is
        return None
    if not isinstance(data, dict) or set(data) != {"ids", "logprobs"}:
        return None
    ids, lps = data["ids"], data["logprobs"]
    if not (isinstance(ids, bytes) and isinstance(lps, bytes)) or len(ids) % 4 or len(ids) != len(lps):
        return None
    if msgpack.packb({"ids": ids, "logprobs": lps}, use_bin_type=True) != fields[b"data"]:
        return None
    return ids, lps


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
