"""Redis connections: one helper, password in the URL, wait instead of dying.

Under ``honcho start`` every process starts at once and one that exits stops
them all, so services wait for Redis to come up rather than fail.
"""

from __future__ import annotations

import time

import redis
import structlog
from redis.backoff import ExponentialBackoff
from redis.retry import Retry


class RedisGone(redis.exceptions.ConnectionError):
    """The server stayed unreachable for ``redis_wait`` seconds: the service stops and says so in one line."""


class _RetryFor(Retry):
    """Retries a command (backoff 0.05 s doubling to 1 s) for up to ``seconds`` after its first failure, then
    logs ONE error line and raises RedisGone."""

    def __init__(self, url: str, seconds: float):
        super().__init__(ExponentialBackoff(cap=1.0, base=0.05), -1)
        self.url, self.seconds = url, seconds

    def call_with_retry(self, do, fail, *args, **kwargs):
        start = time.monotonic()

        def give_up_after_deadline(error, *rest):
            if time.monotonic() - start > self.seconds:
                message = (f"no Redis answering at {redact(self.url)} for {self.seconds:g}s (config redis_wait): "
                           f"giving up ({type(error).__name__}: {error})")
                structlog.get_logger().error("redis_gone", message=message)
                raise RedisGone(message) from error
            return fail(error, *rest)

        return super().call_with_retry(do, give_up_after_deadline, *args, **kwargs)


def _retry(url: str, seconds: float) -> dict:
    """Every command of a connected client retries through a server restart, the AOF load after it (BUSY
    LOADING) included, for up to ``seconds`` (config ``redis_wait``): a service waits for Redis instead of
    dying, and says so in one line when the server is really gone. (A client made by from_url otherwise gets
    no retries at all.)"""
    return {"retry": _RetryFor(url, seconds),
            "retry_on_error": [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                               redis.exceptions.BusyLoadingError]}


def connect(url: str, wait: float = 30.0, redis_wait: float = 30.0, **kwargs) -> redis.Redis:
    """A client once the server answers (waiting up to ``wait`` seconds for the first answer); its commands
    retry for up to ``redis_wait`` seconds when the server goes away."""
    probe = redis.Redis.from_url(url, **kwargs)
    deadline = time.monotonic() + wait
    delay = 0.05
    while True:
        try:
            probe.ping()
            probe.close()
            return redis.Redis.from_url(url, health_check_interval=30, **{**_retry(url, redis_wait), **kwargs})
        except redis.exceptions.AuthenticationError:
            raise
        except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
            if time.monotonic() > deadline:
                raise redis.exceptions.ConnectionError(f"no Redis answering at {redact(url)} after {wait:.0f}s") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def redact(url: str) -> str:
    """The URL with any password hidden, for logs and errors."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
