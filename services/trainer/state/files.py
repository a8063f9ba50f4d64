"""Atomic files: written beside their final name, fsynced, renamed over it, the folder fsynced. A crash leaves the old
file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path

from shared.protocol.archive.jsonl import fsync_dir


def atomic_write(path: Path, write) -> None:
    """``write(tmp_path)``, fsync, rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # the owner's only, from the start
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    os.chmod(tmp, 0o600)
    write(tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
