"""What every service process shares: config from argv, logging, a Redis
connection that waits for the server, a warm shutdown on SIGTERM/SIGINT, and
a heartbeat key other processes use to tell it is alive."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import uuid

import redis

from shared.runtime import config as configmod
from shared.runtime import logs
from shared.runtime.connection import RedisGone, connect, redact
from shared.runtime.heartbeat import Heartbeat
from shared.protocol.keys import Keys


class Service:
    def __init__(self, name: str, argv: list[str] | None = None, extra_args=None):
        parser = argparse.ArgumentParser(prog=f"python -m services.{name}")
        parser.add_argument("--worker-id", help="process id used in events and heartbeats (default host-pid-rand)")
        if extra_args:
            extra_args(parser)
        configmod.add_arguments(parser)
        self.args = parser.parse_args(argv)
        try:
            self.cfg = configmod.from_args(self.args)
        except configmod.ConfigError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        logs.setup(self.cfg.log_level)
        self.name = name
        self.worker_id = self.args.worker_id or f"{name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.log = logs.get(name, worker=self.worker_id, run=self.cfg.run)
        self.keys = Keys(self.cfg.run)
        self.stopping = False
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self.log.info("connecting", redis=redact(self.cfg.redis_url))
        self.client: redis.Redis = connect(self.cfg.redis_url, wait=120, redis_wait=self.cfg.redis_wait)
        sys.excepthook = _one_line_when_redis_is_gone(sys.excepthook)

    def _stop(self, signum, frame) -> None:
        if self.stopping:  # second signal: cold shutdown
            raise SystemExit(1)
        self.stopping = True
        self.log.info("stopping", signal=signal.Signals(signum).name)

    def heartbeat(self, ttl: float | None = None) -> Heartbeat:
        """This process's heartbeat (shared.runtime.heartbeat): call ``beat()`` from the loop."""
        return Heartbeat(self.client, self.keys, self.name, self.worker_id, ttl or self.cfg.heartbeat_ttl)


def _one_line_when_redis_is_gone(hook):
    """A service that gave up on Redis (RedisGone: its one line is already logged) exits without a traceback."""
    def excepthook(kind, value, tb):
        if not isinstance(value, RedisGone):
            hook(kind, value, tb)
    return excepthook
