"""The weight-delta codec (shared/protocol/weights/delta.py): encode / apply give the target file's bytes exactly, any
damage is refused, and the default codec stays within 1.3x of the entropy floor on an AdamW-like update."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from safetensors.torch import save

from shared.protocol.weights import delta as wd


def _file(state: dict, version: int) -> bytes:
    return save(state, metadata={"version": str(version)})


def _pair(fraction=0.02, n=200_000, seed=0, dtype=torch.bfloat16):
    """Two versions of a two-tensor model: ``fraction`` of the elements moved by a small relative step, as a low
    learning rate moves bf16 weights (most round back to the same bits)."""
    g = torch.Generator().manual_seed(seed)
    a = {"w": torch.randn(n, generator=g).to(dtype), "b": torch.randn(n // 4, generator=g).to(dtype)}
    b = {}
    for k, t in a.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        b[k] = torch.where(mask, (t.float() * (1 + 0.02 * torch.randn(t.shape, generator=g))).to(dtype), t)
    return _file(a, 1), _file(b, 2)


@pytest.mark.parametrize("codec", wd.CODECS)
def test_round_trip_is_bit_identical(codec):
    base, target = _pair()
    delta = wd.encode(base, target, 2, 1, codec=codec)
    assert wd.apply(base, delta) == target
    h = wd.read_header(delta)
    assert (h["version"], h["base"], h["codec"], h["word"]) == (2, 1, codec, 2)
    assert h["sha256"] == hashlib.sha256(target).hexdigest() and h["base_sha256"] == hashlib.sha256(base).hexdigest()
    assert 0 < h["changed"] == wd.changed(base, target)[0]


def test_float32_files_and_no_change():
    base, target = _pair(dtype=torch.float32)
    assert wd.read_header(wd.encode(base, target, 2, 1))["word"] == 4
    assert wd.apply(base, wd.encode(base, target, 2, 1)) == target
    # nothing changed: a delta of a header and empty parts
    same = wd.encode(base, base, 2, 1)
    assert wd.read_header(same)["changed"] == 0 and wd.apply(base, same) == base and len(same) < 1000


def test_sparse_is_small_and_near_the_floor():
    base, target = _pair(fraction=0.02)
    floor = wd.entropy_floor_bits(base, target) / 8
    delta = wd.encode(base, target, 2, 1)
    assert len(delta) < 0.05 * len(target)
    # the header (tensor table) is not in the floor
    assert floor < len(delta) < 1.3 * floor + 2048


def test_entropy_floor_of_a_known_change():
    a = torch.zeros(1000, dtype=torch.bfloat16)
    b = a.clone()
    # three elements, one new value: log2 C(1000, 3) bits and nothing for the values
    b[[3, 500, 999]] = 1.0
    bits = wd.entropy_floor_bits(_file({"x": a}, 1), _file({"x": b}, 2))
    assert bits == pytest.approx(math.log2(math.comb(1000, 3)))


def test_a_corrupt_delta_is_refused():
    base, target = _pair()
    delta = bytearray(wd.encode(base, target, 2, 1))
    # one bit in the last value plane
    delta[-7] ^= 0x40
    with pytest.raises(wd.DeltaError, match=r"v1->v2"):
        wd.apply(base, bytes(delta))
    with pytest.raises(wd.DeltaError, match="not a weight delta"):
        wd.apply(base, b"garbage" * 10)
    with pytest.raises(wd.DeltaError, match="after the parts"):
        wd.apply(base, bytes(wd.encode(base, target, 2, 1)) + b"x")


def test_applied_to_another_base_is_refused():
    base, target = _pair(seed=0)
    other, _ = _pair(seed=1)
    with pytest.raises(wd.DeltaError, match="sha256"):
        wd.apply(other, wd.encode(base, target, 2, 1))
    small = _file({"w": torch.zeros(10, dtype=torch.bfloat16)}, 1)
    with pytest.raises(wd.DeltaError, match="words"):
        wd.apply(small, wd.encode(base, target, 2, 1))


def test_another_layout_has_no_delta():
    base, _ = _pair()
    grown = _file({"w": torch.zeros(10, dtype=torch.bfloat16)}, 2)
    with pytest.raises(wd.DeltaError, match="another tensor layout"):
        wd.encode(base, grown, 2, 1)
    with pytest.raises(wd.DeltaError, match="codec"):
        wd.encode(base, base, 2, 1, codec="gzip")
    with pytest.raises(wd.DeltaError, match="not a safetensors file"):
        wd.layout(b"abc")
