"""Weight deltas: version v's published file as the changes from version v-1's. Pure functions on bytes.

At RL learning rates almost every bf16 weight is bit-identical from one version to the next, so a version is sent as
which elements changed and their new bits. A delta is computed on the raw bytes of the two safetensors files: the
target's header (tensor table and metadata, a few KB) is carried whole, and the tensor data, read as words of the
tensors' element size (2 bytes for bf16), is compared word by word. Applying a delta to the base file's bytes gives
the target file's bytes exactly, whatever wrote them; the result is checked against the target's sha256 (in the delta
and, by the caller, the published one) before anyone may load it.

    delta file = MAGIC | u32 header length | msgpack header | the header's ``parts``, each one zstd frame

    header: format, version, base (version numbers), sha256, base_sha256 (of the two full files), size (the target
            file's bytes), data_start (where its tensor data starts), word (element bytes), changed (elements),
            codec, head (the target's bytes before data_start), parts (compressed length of each part)

Codecs (``encode(..., codec=)``; ``bench/weights/delta_sync.py`` measures them side by side):
    sparse   the gaps between changed elements' indices and the XOR of their old and new bits, each split into
             byte planes (all low bytes, then the next ...) and each plane one zstd frame: the default, the smallest
    values   the same gaps, with the new bits themselves instead of the XOR
    xor      the XOR of every word (mostly zeros), byte planes, zstd: no index at all

``entropy_floor_bits``: the bits needed to name the changed elements (log2 C(N, k)) and their new values (k times
the order-0 entropy of their XOR with the old bits, or of the new bits when lower): what any coder of the changes,
element by element, needs at least; the codec's size over it says how much is left to gain.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass

import msgpack
import numpy as np
import zstandard

MAGIC = b"SRLDELTA"
FORMAT = 1
CODECS = ("sparse", "values", "xor")
# zstd level: higher levels gain under 1 % on these planes (measured: bench/weights/delta_sync.py) at 3-10x the time
LEVEL = 3
_ITEMSIZE = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(ValueError):
    """A delta that cannot be made or applied; the message says which file, which field, what was expected."""


@dataclass(frozen=True)
class Layout:
    # bytes before the tensor data (8-byte length + JSON header)
    data_start: int
    # element bytes shared by every tensor (the gcd of their sizes)
    word: int


def layout(blob: bytes, what: str = "weights") -> Layout:
    """Where a safetensors file's tensor data starts and its element width; DeltaError when it is not one."""
    if len(blob) < 8:
        raise DeltaError(f"{what}: {len(blob)} bytes is not a safetensors file (expected an 8-byte header length)")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise DeltaError(f"{what}: header length {n} runs past the file's {len(blob)} bytes (not safetensors)")
    try:
        table = json.loads(blob[8 : 8 + n])
    except ValueError as exc:
        raise DeltaError(f"{what}: header is not JSON ({exc})") from None
    sizes = {_ITEMSIZE.get(t.get("dtype"), 1) for k, t in table.items() if k != "__metadata__"}
    word = math.gcd(*sizes) if sizes else 1
    if (len(blob) - 8 - n) % word:
        word = 1
    return Layout(8 + n, word)


def _planes(a: np.ndarray) -> list[bytes]:
    """``a``'s bytes as byte planes: every element's lowest byte, then the next ... (little-endian)."""
    b = np.ascontiguousarray(a).view(np.uint8).reshape(len(a), a.itemsize)
    return [b[:, i].tobytes() for i in range(a.itemsize)]


def _unplanes(planes: list[bytes], dtype, n: int, what: str) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    if len(planes) != width or any(len(p) != n for p in planes):
        raise DeltaError(f"{what}: expected {width} byte planes of {n} bytes, got {[len(p) for p in planes]}")
    out = np.empty((n, width), dtype=np.uint8)
    for i, p in enumerate(planes):
        out[:, i] = np.frombuffer(p, dtype=np.uint8)
    return out.reshape(-1).view(dtype)


def _words(blob: bytes, lay: Layout) -> np.ndarray:
    return np.frombuffer(blob, dtype=_UINT[lay.word], offset=lay.data_start)


def changed(base: bytes, target: bytes) -> tuple[int, int]:
    """(elements that differ, elements) between two files of one layout."""
    lb, lt = layout(base, "base"), layout(target, "target")
    old, new = _words(base, lb), _words(target, lt)
    if lb.word != lt.word or len(old) != len(new):
        raise DeltaError(f"target: {len(new)} words of {lt.word} bytes, base {len(old)} of {lb.word}: another layout")
    return int(np.count_nonzero(old != new)), len(new)


def encode(
    base: bytes,
    target: bytes,
    version: int,
    base_version: int,
    codec: str = "sparse",
    base_sha256: str = "",
    sha256: str = "",
) -> bytes:
    """The delta that turns ``base`` (version ``base_version``'s file) into ``target`` (``version``'s). DeltaError
    when the two tensor data regions differ in length or element size (a new layout: publish a snapshot)."""
    if codec not in CODECS:
        raise DeltaError(f"codec {codec!r}: expected one of {', '.join(CODECS)}")
    lb, lt = layout(base, f"v{base_version}"), layout(target, f"v{version}")
    old, new = _words(base, lb), _words(target, lt)
    if lb.word != lt.word or len(old) != len(new):
        raise DeltaError(
            f"v{version}: {len(new)} words of {lt.word} bytes against v{base_version}'s {len(old)} of "
            f"{lb.word}: another tensor layout, no delta (a snapshot instead)"
        )
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    if codec == "xor":
        idx, gap_bytes = None, 0
        planes = _planes(old ^ new)
    else:
        idx = np.flatnonzero(old != new)
        # >= 1
        gaps = np.diff(idx, prepend=-1)
        gap_type = np.uint32 if len(idx) == 0 or int(gaps.max()) < 2**32 else np.uint64
        vals = new[idx] if codec == "values" else old[idx] ^ new[idx]
        gap_bytes = np.dtype(gap_type).itemsize
        planes = _planes(gaps.astype(gap_type)) + _planes(vals)
    parts = [cctx.compress(p) for p in planes]
    header = {
        "format": FORMAT,
        "version": version,
        "base": base_version,
        "sha256": sha256 or hashlib.sha256(target).hexdigest(),
        "base_sha256": base_sha256 or hashlib.sha256(base).hexdigest(),
        "size": len(target),
        "data_start": lt.data_start,
        "word": lt.word,
        "changed": int(len(idx) if idx is not None else np.count_nonzero(old != new)),
        "codec": codec,
        "gap_bytes": gap_bytes,
        "head": bytes(target[: lt.data_start]),
        "parts": [len(p) for p in parts],
    }
    packed = msgpack.packb(header, use_bin_type=True)
    return b"".join([MAGIC, struct.pack("<I", len(packed)), packed, *parts])


def read_header(delta: bytes, what: str = "delta") -> dict:
    """The delta's header (without ``head``'s check); DeltaError naming the field when it is not a delta."""
    if delta[: len(MAGIC)] != MAGIC:
        raise DeltaError(f"{what}: does not start with {MAGIC!r} (not a weight delta)")
    if len(delta) < len(MAGIC) + 4:
        raise DeltaError(f"{what}: truncated before its header length")
    (n,) = struct.unpack("<I", delta[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    try:
        header = msgpack.unpackb(delta[start : start + n], raw=False)
    except (ValueError, msgpack.exceptions.ExtraData) as exc:
        raise DeltaError(f"{what}: header is not msgpack ({exc})") from None
    if not isinstance(header, dict):
        raise DeltaError(f"{what}: header is a {type(header).__name__}, expected a map")
    for field, kind in (
        ("format", int),
        ("version", int),
        ("base", int),
        ("sha256", str),
        ("base_sha256", str),
        ("size", int),
        ("data_start", int),
        ("word", int),
        ("changed", int),
        ("codec", str),
        ("gap_bytes", int),
        ("head", bytes),
        ("parts", list),
    ):
        if not isinstance(header.get(field), kind):
            raise DeltaError(f"{what}: header field {field!r} missing or not {kind.__name__}: {header.get(field)!r}")
    if header["format"] != FORMAT:
        raise DeltaError(f"{what}: format {header['format']}, this code reads {FORMAT}")
    if header["codec"] not in CODECS or header["word"] not in _UINT:
        raise DeltaError(f"{what}: codec {header['codec']!r} / word {header['word']}: expected {CODECS} / 1, 2, 4, 8")
    header["body_start"] = start + n
    return header


def apply(base: bytes, delta: bytes, what: str = "delta", check: bool = True) -> bytes:
    """The target file's bytes: ``delta`` applied to ``base``; checked against the delta's sha256 of the target
    (DeltaError when they differ: a corrupt delta, or one made against another base)."""
    return bytes(apply_chain(base, [delta], what) if check else _apply(bytearray(base), delta, what)[0])


def apply_chain(base: bytes, deltas: list[bytes], what: str = "delta") -> bytearray:
    """``deltas`` applied one after the other to ``base``, in one buffer; only the result is hashed, against the
    last delta's sha256 (a wrong step anywhere makes it differ). DeltaError naming the step that fails."""
    out, h = bytearray(base), None
    for i, delta in enumerate(deltas):
        out, h = _apply(out, delta, what if len(deltas) == 1 else f"{what} (step {i + 1} of {len(deltas)})")
    if h is not None:
        digest = hashlib.sha256(out).hexdigest()
        if digest != h["sha256"]:
            raise DeltaError(
                f"{what} v{deltas and read_header(deltas[0])['base']}->v{h['version']}: result sha256 "
                f"{digest[:12]}... is not the target's {h['sha256'][:12]}... (corrupt delta, or applied "
                f"to another base)"
            )
    return out


def _apply(buf: bytearray, delta: bytes, what: str) -> tuple[bytearray, dict]:
    """``delta`` applied to the file in ``buf`` (changed in place when the header keeps its length)."""
    h = read_header(delta, what)
    what = f"{what} v{h['base']}->v{h['version']}"
    lb = layout(buf, f"{what} base")
    word, start = h["word"], h["data_start"]
    count = (h["size"] - start) // word
    if lb.word != word or (len(buf) - lb.data_start) // word != count:
        raise DeltaError(
            f"{what}: the base holds {(len(buf) - lb.data_start) // lb.word} words of {lb.word} bytes, "
            f"the delta expects {count} of {word} (applied to another version's file?)"
        )
    frames, at = [], h["body_start"]
    dctx = zstandard.ZstdDecompressor()
    try:
        for length in h["parts"]:
            frames.append(dctx.decompress(delta[at : at + length]))
            at += length
    except zstandard.ZstdError as exc:
        raise DeltaError(f"{what}: part {len(frames)} does not decompress ({exc}): corrupt delta") from None
    if at != len(delta):
        raise DeltaError(f"{what}: {len(delta) - at} bytes after the parts the header lists (expected none)")
    if lb.data_start == start:
        out = buf
        out[:start] = h["head"]
    # the header changed length (its metadata): the data moves
    else:
        out = bytearray(h["head"]) + buf[lb.data_start :]
    new = np.frombuffer(out, dtype=_UINT[word], offset=start)
    if h["codec"] == "xor":
        new ^= _unplanes(frames, _UINT[word], count, what)
    else:
        g = h["gap_bytes"]
        if len(frames) != g + word or g not in (4, 8):
            raise DeltaError(f"{what}: {len(frames)} parts, expected {g} gap planes + {word} value planes")
        k = h["changed"]
        idx = np.cumsum(_unplanes(frames[:g], _UINT[g], k, what).astype(np.int64)) - 1
        if k and (idx[0] < 0 or idx[-1] >= count):
            raise DeltaError(f"{what}: changed element index {int(idx[-1])} outside the {count} elements")
        vals = _unplanes(frames[g:], _UINT[word], k, what)
        new[idx] = vals if h["codec"] == "values" else new[idx] ^ vals
    return out, h


def _entropy_bits(symbols: np.ndarray) -> float:
    """Order-0 empirical entropy of ``symbols``, in bits, all of them together."""
    if len(symbols) == 0:
        return 0.0
    counts = np.unique(symbols, return_counts=True)[1] if symbols.itemsize > 2 else np.bincount(symbols)
    p = counts[counts > 0] / len(symbols)
    return float(-(p * np.log2(p)).sum() * len(symbols))


def entropy_floor_bits(base: bytes, target: bytes) -> float:
    """The bits needed to name the changed elements (log2 C(N, k)) and their new values (the order-0 entropy of the
    lower of: their XOR with the old bits, the new bits themselves), the header not counted."""
    lb, lt = layout(base, "base"), layout(target, "target")
    old, new = _words(base, lb), _words(target, lt)
    if lb.word != lt.word or len(old) != len(new):
        raise DeltaError("entropy floor: the two files differ in layout")
    idx = np.flatnonzero(old != new)
    n, k = len(new), len(idx)
    positions = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
    values = min(_entropy_bits(old[idx] ^ new[idx]), _entropy_bits(new[idx]))
    return positions + values
