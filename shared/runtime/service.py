"""What every service process shares: config from argv, logging, a Redis
connection that waits for the server, a warm shutdown on SIGTERM/SIGINT, and
a heartbeat key other processes use to tell it is alive."""

from __future__ import annotations

import argparse
import atexit
import gc
import signal
import sys

import redis

from shared.protocol.keys import Keys
from shared.runtime import logs, runstate, secrets
from shared.runtime.config import sources as config_sources
from shared.runtime.config.errors import ConfigError
from shared.runtime.connection import connect, redact
from shared.runtime.heartbeat import Heartbeat, new_worker_id

# the config sections (full-line comments in shared/runtime/config/keys.py) each service's --help lists
SHOWN = {
    "rollout": ("where", "episode log", "model", "rollout", "staleness"),
    "trainer": ("where", "model", "trainer", "staleness"),
    "syncer": ("where", "staleness"),
    "tools": ("where", "rollout"),
}


class Service:
    def __init__(self, name: str, argv: list[str] | None = None, extra_args=None):
        parser = argparse.ArgumentParser(prog=f"python -m services.{name}")
        parser.add_argument("--worker-id", help="process id used in events and heartbeats (default host-pid-rand)")
        if extra_args:
            extra_args(parser)
        config_sources.add_arguments(parser, SHOWN.get(name))
        self.args = parser.parse_args(argv)
        try:
            self.cfg = config_sources.from_args(self.args)
        except ConfigError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        logs.setup(self.cfg.log_level)
        self.name = name
        self.worker_id = self.args.worker_id or new_worker_id(name)
        self.log = logs.get(name, worker=self.worker_id, run=self.cfg.run)
        self.keys = Keys(self.cfg.run)
        self.stopping = False
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        sys.excepthook = self._excepthook
        self.log.info("connecting", redis=redact(self.cfg.redis_url))
        # (honcho start: `streamrl redis` makes the secrets)
        self.cfg, self.client = secrets.connect_run(self.cfg)
        try:
            self.meta = runstate.bind(
                self.client, self.keys, self.cfg.run_path, self.cfg.redis_url, config=runstate.recordable(self.cfg)
            )
            # keys the default weights folders
            self.cfg = self.cfg.replace(run_id=self.meta["id"])
        except runstate.RunStateError as exc:
            print(f"{name}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        self._rq_client = None
        # the warm shutdown is done by then: skip collecting torch's and transformers' objects one by one at
        # interpreter exit (2-4 s measured on 2 busy cores), which honcho's 5 s before SIGKILL does not always cover
        atexit.register(gc.freeze)

    @property
    def rq_client(self) -> redis.Redis:
        """The client of the rq job queues' server: ``rq_redis_url`` when set (a run on a Redis Cluster), else the
        run's own client."""
        if not self.cfg.rq_redis_url:
            return self.client
        if self._rq_client is None:
            self._rq_client = connect(self.cfg.rq_redis_url, wait=self.cfg.redis_wait)
        return self._rq_client

    def rq_connect(self) -> redis.Redis:
        """A new client of the rq queues' server (one per rq worker thread)."""
        return connect(self.cfg.rq_redis_url or self.cfg.redis_url, wait=self.cfg.redis_wait)

    def _excepthook(self, kind, exc, tb) -> None:
        """A Redis that stayed gone for redis_wait seconds (the client's retries are spent), or one out of memory:
        one line, no traceback."""
        if issubclass(kind, redis.exceptions.OutOfMemoryError):
            print(f"{self.name}: {out_of_memory_line(self.cfg)}; stopping", file=sys.stderr, flush=True)
        elif issubclass(kind, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
            print(
                f"{self.name}: Redis at {redact(self.cfg.redis_url)} is gone: no answer within redis_wait = "
                f"{self.cfg.redis_wait:g} s ({exc}); stopping",
                file=sys.stderr,
                flush=True,
            )
        else:
            sys.__excepthook__(kind, exc, tb)

    def _stop(self, signum, frame) -> None:
        # second signal: cold shutdown
        if self.stopping:
            raise SystemExit(1)
        self.stopping = True
        self.log.info("stopping", signal=signal.Signals(signum).name)

    def heartbeat(self, ttl: float | None = None) -> Heartbeat:
        """This process's heartbeat (shared.runtime.heartbeat): call ``beat()`` from the loop."""
        return Heartbeat(self.client, self.keys, self.name, self.worker_id, ttl or self.cfg.heartbeat_ttl)


def out_of_memory_line(cfg) -> str:
    """What a service says when Redis refuses a write for want of memory (``OutOfMemoryError``, noeviction)."""
    retention = (
        (
            f"lower log_retention_versions (now {cfg.log_retention_versions}: episodes of older versions move "
            f"to Parquet segments)"
        )
        if cfg.log_retention_versions
        else "set log_retention_versions (episodes of old versions move to Parquet segments; "
        "0 keeps every one in Redis)"
    )
    return f"Redis is out of memory (maxmemory {cfg.redis_maxmemory}): raise redis_maxmemory or {retention}"
