"""Where the ui reads each run: a client on the server that serves it (live), or on a copy of its data served for the
ui (ended, interrupted, archived: services/ops/inspect/serve_ended.py), opened on first use and kept; and its episode
index, brought up to date in a background thread (never inside a request)."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import redis
import structlog

from services.ops.inspect import run_target, serve_ended
from services.ops.ui.index import EpisodeIndex
from shared.protocol.archive import segments
from shared.protocol.keys import Keys
from shared.runtime import secrets
from shared.runtime.connection import connect

# a live run's index is brought up to date at most this often
REFRESH_S = 2.0


def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except (redis.exceptions.RedisError, OSError):
        return False


class NoRun(LookupError):
    pass


class RunSource:
    def __init__(self, folder: str, target: run_target.Target, client, served: bool, stack: contextlib.ExitStack):
        self.folder, self.target, self.client, self.served, self.stack = folder, target, client, served, stack
        self.keys, self.path = target.keys, target.path
        self.log = structlog.get_logger("ui").bind(run=folder, served=served)
        # the run's segments (episodes the archiver moved out of Redis): the index and the episode page read both tiers
        self.archive = segments.SegmentStore(segments.folder_of(self.path)) if self.path is not None else None
        self.index = EpisodeIndex(
            client, self.keys, self.path, (target.marker or {}).get("id", ""), archive=self.archive
        )
        self.loaded = self.index.load()
        self._refreshing = threading.Lock()
        self._last = 0.0
        self.error = ""
        self.check: dict | None = None
        # refreshed once since opened (a kept index may miss what ended after it was saved)
        self.ready = False

    @property
    def ended(self) -> bool:
        # nothing writes to a copy: its index, once built, is complete
        return self.served

    def refresh_soon(self) -> None:
        """Start a refresh in the background when one is due and none runs."""
        if self.client is None:
            return
        due = not self.ready or (not self.ended and time.monotonic() - self._last > REFRESH_S)
        if due and self._refreshing.acquire(blocking=False):
            threading.Thread(target=self._refresh, daemon=True, name=f"ui-index-{self.folder}").start()

    def _refresh(self) -> None:
        try:
            first = not self.ready
            n = self.index.refresh()
            self.ready, self.error = True, ""
            if first or n:
                self.log.info(
                    "episode index",
                    read=n,
                    rows=len(self.index.table),
                    seconds=round(self.index.last_refresh_s, 3),
                    cached=self.loaded,
                )
        except redis.exceptions.RedisError as exc:
            self.error = f"Redis: {exc}"
            self.log.warning("episode index refresh failed", error=str(exc))
        finally:
            self._last = time.monotonic()
            self._refreshing.release()


class Sources:
    """{run folder: RunSource}, opened on demand; ``close`` stops every served copy."""

    def __init__(self, cfg, sources: dict):
        self.cfg, self.sources = cfg, sources
        self.runs: dict[str, RunSource] = {}
        self.stack = contextlib.ExitStack()
        self._lock = threading.Lock()

    def folder_path(self, folder: str) -> Path:
        if not folder or "/" in folder or folder.startswith("."):
            raise NoRun(f"run {folder!r}: expected a folder name under run_dir")
        path = Path(self.cfg.run_dir) / folder
        if not path.is_dir():
            raise NoRun(f"run {folder!r}: no folder {path}")
        return path

    def get(self, folder: str) -> RunSource:
        with self._lock:
            src = self.runs.get(folder)
            if src is not None and not src.served and src.client is not None and not _answers(src.client):
                # a live run's server went away (the run ended): read it from its folder now
                src = None
            if src is None:
                src = self.runs[folder] = self._open(folder)
        return src

    def forget(self, folder: str) -> None:
        """Drop a run whose server went away (a live run that ended): the next use opens it again."""
        with self._lock:
            self.runs.pop(folder, None)

    def _open(self, folder: str) -> RunSource:
        self.folder_path(folder)
        base = secrets.without_password(self.cfg.redis_url) if "redis_url" not in self.sources else self.cfg.redis_url
        cfg, _ = secrets.apply(self.cfg.replace(run=folder, redis_url=base))
        target, _ = run_target.resolve(cfg, self.sources)
        url, served = run_target.serving_url(target, self.sources) or self._own_server(target), False
        if url is None:
            if not serve_ended.has_data(target.path):
                return RunSource(folder, target, None, False, self.stack)
            url, served = self.stack.enter_context(serve_ended.ServedCopy(target.path)), True
        return RunSource(folder, target, connect(url, wait=3.0), served, self.stack)

    def is_live(self, folder: Path, marker: dict) -> bool:
        """Whether a server holds the run of ``folder`` now (the runs page's state)."""
        target = run_target.Target(self.cfg, Keys(marker.get("run", folder.name)), folder, marker)
        return run_target.serving_url(target, {}) is not None or self._own_server(target) is not None

    def _own_server(self, target: run_target.Target) -> str | None:
        """The embedded server `streamrl run` started for the run (its secrets file names it, on any port), when
        it holds the run now."""
        try:
            data = secrets.read(target.path)
        except ValueError:
            return None
        if "redis_url" in self.sources or not data.get("redis_server"):
            return None
        url = secrets.with_password(f"redis://{data['redis_server']}/0", data.get("redis_password", ""))
        return url if run_target.holds_run(url, target) else None

    def close(self) -> None:
        self.stack.close()
