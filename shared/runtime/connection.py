"""Redis connections: one helper, password in the URL, wait instead of dying.

Under ``honcho start`` every process starts at once and one that exits stops
them all, so services wait for Redis to come up rather than fail.
"""

from __future__ import annotations

import time

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry


def _retry() -> dict:
    """Every command of a connected client retries through a server restart (about two minutes of
    backoff, at most 1 s between tries), the AOF load after it (BUSY LOADING) included: a service
    waits for Redis instead of dying. (A client made by from_url otherwise gets no retries at all.)"""
    return {"retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), 130),
            "retry_on_error": [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                               redis.exceptions.BusyLoadingError]}


def connect(url: str, wait: float = 30.0, **kwargs) -> redis.Redis:
    """A client once the server answers (waiting up to ``wait`` seconds for the first answer)."""
    probe = redis.Redis.from_url(url, **kwargs)
    deadline = time.monotonic() + wait
    delay = 0.05
    while True:
        try:
            probe.ping()
            probe.close()
            return redis.Redis.from_url(url, health_check_interval=30, **{**_retry(), **kwargs})
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
