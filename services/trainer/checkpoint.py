"""Atomic checkpoints (the ledger's format is shared.protocol.ledger).

A checkpoint holds model, optimizer, RNG, step, version and the ids of every
prompt group whose training it includes. It is written to a temporary file,
fsynced and renamed, so a crash leaves the old or the new one, never half.
Samples are acknowledged in Redis only after the checkpoint including them is
durable; the ledger lists, per commit, the groups it includes (the checkpoint
holds its own ledger line and restore re-appends it when the ledger is behind).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """``write(tmp_path)``, fsync, rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save(directory: Path, state: dict) -> None:
    atomic_write(directory / "checkpoint.pt", lambda tmp: torch.save(state, tmp))


def load(directory: Path) -> dict | None:
    path = directory / "checkpoint.pt"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
