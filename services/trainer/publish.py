"""Publishing a policy version: its weights as safetensors bytes (in the publish dtype), the sha256 of those bytes,
and a version event on the ``versions`` stream (plain fields: version, path, sha256, step, time, and url when the
trainer serves its weights over HTTP). The file the event names may be made later from deltas
(``shared/runtime/weights/chain.py``); its bytes, and so its sha256, are these."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors.torch import save as save_bytes

from services.trainer.state.files import atomic_write
from shared.protocol.keys import Keys
from shared.protocol.streams import versions
from shared.runtime.weights.checksum import sha256_file
from shared.runtime.weights.server import PREFIX


def frozen(state, dtype: str = "", into: dict | None = None) -> dict[str, torch.Tensor]:
    """``state`` (``Policy.publish_state``, or a model) copied now, on the CPU, in ``dtype`` (config publish_dtype:
    floating tensors only; empty: as they are): training may change its own tensors while this copy is written.
    ``into``: an earlier copy no one reads any more, whose tensors are reused where they fit (no fresh allocation,
    and its page faults, per version)."""
    state = state.state_dict() if hasattr(state, "state_dict") else state
    cast = getattr(torch, dtype) if dtype else None
    out = {}
    for k, v in state.items():
        want = cast if cast is not None and v.is_floating_point() else v.dtype
        buf = (into or {}).get(k)
        if buf is not None and buf.shape == v.shape and buf.dtype == want:
            out[k] = buf.copy_(v.detach())
            continue
        copy = v.detach().to("cpu", dtype=want).contiguous()
        out[k] = copy.clone() if copy.data_ptr() == v.data_ptr() else copy
    return out


def serialize(weights: dict[str, torch.Tensor], version: int) -> bytes:
    """The version's file, as bytes (deterministic: the same weights give the same bytes and sha256)."""
    return save_bytes(weights, metadata={"version": str(version)})


def write_weights(state, directory: Path, version: int, dtype: str = "") -> tuple[Path, str]:
    """Write ``state`` as version ``version``'s full file; (path, sha256)."""
    path = directory / f"v{version:06d}.safetensors"
    data = serialize(frozen(state, dtype), version)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))
    return path, sha256(path)


sha256 = sha256_file


def publish(client, keys: Keys, version: int, path: Path, digest: str, step: int, url_base: str = "") -> None:
    """The version event; with ``url_base`` (the weight server, config weights_url) it says where to download it."""
    url = f"{url_base.rstrip('/')}{PREFIX}{path.name}" if url_base else ""
    versions.publish(client, keys, versions.Version(version, str(path.resolve()), digest, step, time.time(), url=url))


def latest_version(client, keys: Keys) -> int:
    """The newest published version number, 0 when none."""
    return versions.latest_number(client, keys)


def prune(directory: Path, keep_from: int) -> None:
    """Delete what no worker can need: files, deltas and lock files of versions before the newest full file at or
    before ``keep_from`` (the base every later version can be made from: ``shared/runtime/weights/chain.py``)."""
    files = sorted(_version(p.name) for p in directory.glob("v*.safetensors") if _version(p.name) is not None)
    bases = [v for v in files if v <= keep_from]
    if not bases:
        return
    cut = bases[-1]
    for path in [*directory.glob("v*.safetensors"), *directory.glob("v*.delta"), *directory.glob(".v*")]:
        version = _version(path.name.lstrip("."))
        if version is not None and version < cut:
            path.unlink(missing_ok=True)


def _version(name: str) -> int | None:
    try:
        return int(name[1:].split(".")[0])
    except ValueError:
        return None
