"""The default weights folders: per user, private, one per run id, so no two runs (nor two checkouts, nor two
users) ever share one. ``/dev/shm/streamrl-<uid>/`` (0700) holds ``<run>-<id>/`` (a run's published versions)
and ``<run>-<id>-fetched/`` (a rollout worker's downloads); without /dev/shm they are in the run's folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shared.runtime.config.errors import ConfigError

SHM = Path("/dev/shm")


def shared_memory_root() -> Path | None:
    """This user's folder in shared memory, or None where there is no /dev/shm."""
    return SHM / f"streamrl-{os.getuid()}" if SHM.is_dir() else None


def private_folder(path: Path, key: str, create: bool = True) -> Path:
    """Create ``path`` (and, when it is under :func:`shared_memory_root`, that root) mode 0700; an existing one
    that another user owns is refused in one line naming the config ``key`` that chose it. ``create=False``: only
    the root is created now (``path`` is made when first needed, inside it)."""
    path = Path(path)
    root = shared_memory_root()
    for folder in ([root] if root is not None and root in path.parents else []) + [path]:
        if folder == path and not create and not path.exists():
            break
        try:
            folder.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
        st = folder.stat()
        if st.st_uid != os.getuid():
            raise ConfigError(
                f"config key {key!r}: {folder} belongs to another user (uid {st.st_uid}, not "
                f"{os.getuid()}); set {key} to a folder of your own"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"config key {key!r}: {folder} is not a folder")
    return path
