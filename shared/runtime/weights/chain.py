"""A version's full file, made on this host from the deltas the trainer writes.

The trainer writes a full ``v<N>.safetensors`` only now and then (the first version after a start, every
``publish_full_every`` versions, a delta too large); every other version is its delta ``v<N>.delta`` against the
version before (services/trainer/publisher.py). The version event still names ``v<N>.safetensors``: whoever first needs
that file (a rollout worker on the trainer's host, the weight server asked by a worker too far behind for deltas, an
export) makes it with ``make``: the newest full file before it, the deltas since applied in one buffer, the result
checked against the last delta's target sha256 (and the published one, when given), then written atomically. Makers
sharing the folder take turns on a version (the same lock file a download takes): the second finds it made.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from shared.protocol.archive.jsonl import fsync_dir
from shared.protocol.weights import delta as weight_delta
from shared.runtime.weights.server import DELTA, NAME, delta_name, file_name


class ChainError(ValueError):
    """The file cannot be made here: the message names the version, the folder and what is missing or wrong."""


def full_versions(folder: Path) -> list[int]:
    """Versions with a full file in ``folder``, oldest first."""
    return sorted(_version(p.name) for p in Path(folder).glob("v*.safetensors") if NAME.fullmatch(p.name))


def delta_versions(folder: Path) -> list[int]:
    return sorted(_version(p.name) for p in Path(folder).glob("v*.delta") if DELTA.fullmatch(p.name))


def can_make(folder: Path, version: int) -> bool:
    """``version``'s file is here, or its delta and a full file before it are."""
    folder = Path(folder)
    if (folder / file_name(version)).is_file():
        return True
    return (folder / delta_name(version)).is_file() and any(v < version for v in full_versions(folder))


def make(folder: Path, version: int, sha256: str = "") -> Path:
    """``folder``'s ``v<N>.safetensors`` for ``version``: there already, or made from the chain (see above)."""
    folder = Path(folder)
    final = folder / file_name(version)
    if final.is_file():
        return final
    with open(folder / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_file():
            return final
        bases = [v for v in full_versions(folder) if v < version]
        if not bases:
            raise ChainError(f"weights v{version}: no full file before it in {folder} to apply deltas to")
        base = bases[-1]
        steps = [folder / delta_name(v) for v in range(base + 1, version + 1)]
        missing = [p.name for p in steps if not p.is_file()]
        if missing:
            raise ChainError(
                f"weights v{version}: from v{base}'s file in {folder}, the deltas {', '.join(missing[:5])} are missing"
            )
        try:
            data = weight_delta.apply_chain((folder / file_name(base)).read_bytes(), [p.read_bytes() for p in steps])
        except weight_delta.DeltaError as exc:
            raise ChainError(f"weights v{version}: {exc}") from None
        if sha256 and hashlib.sha256(data).hexdigest() != sha256:
            raise ChainError(
                f"weights v{version}: made from v{base} and {len(steps)} deltas, its sha256 is not the published "
                f"{sha256[:12]}..."
            )
        tmp = folder / f".{final.name}.made"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
        fsync_dir(folder)
    return final


def _version(name: str) -> int:
    return int(name[1:].split(".")[0])
