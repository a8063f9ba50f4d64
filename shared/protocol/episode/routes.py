"""Expert routes of a mixture-of-experts policy: what the ``tokens`` event's ``routes`` field holds, and the one
codec for it. Pure numpy, no I/O.

A sampled token's route is, for every MoE layer, the set of experts the router chose at the position whose logits
sampled it: the token before it (the prompt's last token for the first response token). So a route is known the
moment its token is drawn, travels in the same entry, and is exactly what the trainer must replay at the input
position that predicts the token (its target position). The prompt's other positions are not stored: the trainer
routes them itself.

Wire form (a msgpack map):

    layers  int   MoE layers L (dense layers of a mixed model are not counted)
    k       int   experts chosen per token and layer (top-k)
    planes  bin   the expert indices as L*k planes of n bytes each (n: the entry's token count), plane (l, j)
                  holding the j-th smallest expert of layer l for every token in order; one byte per index
                  where the model has at most 256 experts, else two (little-endian uint16): the width is
                  ``len(planes) / (L*k*n)``

Each plane is one slowly varying byte series (a layer's choice for consecutive tokens), which compresses far
better than interleaved per-token records. In memory a route array is ``[n, L, k]`` of uint8 or uint16, each
row sorted ascending (a route is a set: the order the router ranked its choices in changes nothing it computes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.protocol.episode.errors import EventError


@dataclass(frozen=True, slots=True)
class RouteShape:
    """What a model's routes look like: MoE layers, experts per token (top-k), and experts per layer."""

    layers: int
    top_k: int
    experts: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.experts <= 256 else "<u2")

    def to_dict(self) -> dict:
        return {"layers": self.layers, "top_k": self.top_k, "experts": self.experts}

    def describe(self) -> str:
        return f"{self.layers} MoE layers, top-{self.top_k} of {self.experts} experts"


def canonical(routes: np.ndarray, shape: RouteShape) -> np.ndarray:
    """Indices [n, L, k] (any integer type, any order within a layer) -> the in-memory form: sorted, narrowest type."""
    return np.sort(np.asarray(routes), axis=-1).astype(shape.dtype, copy=False)


def pack(routes: np.ndarray) -> dict:
    """Route array [n, L, k] (uint8 or uint16) -> the wire map."""
    routes = np.asarray(routes)
    n, layers, k = routes.shape
    width = np.dtype(np.uint8) if routes.dtype == np.uint8 else np.dtype("<u2")
    planes = np.ascontiguousarray(routes.astype(width, copy=False).transpose(1, 2, 0))
    return {"layers": int(layers), "k": int(k), "planes": planes.tobytes()}


def unpack(entry_id: str, field: str, value, num_tokens: int) -> np.ndarray:
    """The wire map of an entry with ``num_tokens`` ids -> route array [n, L, k]; EventError naming what is wrong."""
    if not isinstance(value, dict):
        raise EventError(entry_id, field, f"expected a map with layers, k and planes, got {type(value).__name__}")
    for name in ("layers", "k"):
        raw = value.get(name)
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
            raise EventError(entry_id, f"{field}.{name}", f"expected a positive integer, got {raw!r}")
    planes = value.get("planes")
    if not isinstance(planes, bytes):
        raise EventError(entry_id, f"{field}.planes", f"expected bytes, got {type(planes).__name__}")
    layers, k = value["layers"], value["k"]
    cells = layers * k * num_tokens
    if cells == 0 or len(planes) not in (cells, 2 * cells):
        raise EventError(
            entry_id,
            f"{field}.planes",
            f"expected {cells} or {2 * cells} bytes ({layers} layers x top-{k} x {num_tokens} tokens, "
            f"one or two bytes per expert index), got {len(planes)}",
        )
    dtype = np.uint8 if len(planes) == cells else np.dtype("<u2")
    return np.frombuffer(planes, dtype=dtype).reshape(layers, k, num_tokens).transpose(2, 0, 1)


def mismatch(entry_id: str, field: str, routes: np.ndarray, shape: RouteShape) -> EventError | None:
    """None when ``routes`` [n, L, k] fit a model of ``shape``, else the error naming what does not."""
    _, layers, k = routes.shape
    if (layers, k) != (shape.layers, shape.top_k):
        return EventError(entry_id, field, f"routes of {layers} layers x top-{k} for a model with {shape.describe()}")
    top = int(routes.max()) if routes.size else 0
    if top >= shape.experts:
        return EventError(entry_id, field, f"expert index {top} for a model with {shape.experts} experts per layer")
    return None


def changed_layers(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """[n] how many layers route each token to a different set of experts in ``after`` than in ``before``."""
    return (np.asarray(before) != np.asarray(after)).any(axis=-1).sum(axis=-1)
