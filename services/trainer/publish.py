"""Publishing a policy version: safetensors file (atomic rename, sha256) and a
version event on the ``versions`` stream (plain fields: version, path, sha256,
step, time, and url when the trainer serves its weights over HTTP)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.trainer.checkpoint import atomic_write
from shared.protocol.keys import Keys
from shared.protocol.streams import versions
from shared.runtime.weights.checksum import sha256_file
from shared.runtime.weights.server import PREFIX


def write_weights(state, directory: Path, version: int, dtype: str = "") -> tuple[Path, str]:
    """``state``: the policy's weights under the base model's names (``Policy.publish_state``), or a model.
    ``dtype`` (config publish_dtype): floating tensors are written in it (the serving dtype); empty: as they are."""
    path = directory / f"v{version:06d}.safetensors"
    state = state.state_dict() if hasattr(state, "state_dict") else state
    cast = getattr(torch, dtype) if dtype else None
    state = {
        k: v.detach().to("cpu", dtype=cast if cast is not None and v.is_floating_point() else None).contiguous()
        for k, v in state.items()
    }
    atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata={"version": str(version)}))
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
    """Delete published files (and deltas) older than ``keep_from`` (no worker can still need them)."""
    for path in [*directory.glob("v*.safetensors"), *directory.glob("v*.delta")]:
        try:
            if int(path.stem[1:]) < keep_from:
                path.unlink(missing_ok=True)
        except ValueError:
            continue
