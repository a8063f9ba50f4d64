"""A run's Redis data served for one command when no server serves it (an ended, interrupted or archived run):
a copy of ``<run folder>/redis`` on a free loopback port, so the run's folder stays byte-for-byte as it was, and
the server and the copy are gone once the command is done."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from secrets import token_urlsafe

from services.ops.launch.redis_server import EmbeddedRedis


def has_data(run_path: Path) -> bool:
    folder = Path(run_path) / "redis"
    return folder.is_dir() and any(p.is_file() for p in folder.rglob("*"))


class ServedCopy:
    """``with ServedCopy(run_path) as url:``: the one place an ended run's data is started (read-only use)."""

    def __init__(self, run_path: Path):
        self.run_path = Path(run_path)
        self.scratch: Path | None = None
        self.server: EmbeddedRedis | None = None

    def __enter__(self) -> str:
        self.scratch = Path(tempfile.mkdtemp(prefix="streamrl-served-"))
        try:
            shutil.copytree(self.run_path / "redis", self.scratch / "redis", symlinks=True)
            # a password of its own (the copy holds the run's data; other local users must not read it meanwhile)
            self.server = EmbeddedRedis(self.scratch / "redis", password=token_urlsafe(24)).start()
        except BaseException:
            self.__exit__()
            raise
        return self.server.url

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
