"""Redis connections: one helper, password in the URL, wait instead of dying.

Under ``honcho start`` every process starts at once and one that exits stops
them all, so services wait for Redis to come up rather than fail.
"""

from __future__ import annotations

import time

import redis


def connect(url: str, wait: float = 30.0, **kwargs) -> redis.Redis:
    client = redis.Redis.from_url(url, health_check_interval=30, **kwargs)
    deadline = time.monotonic() + wait
    delay = 0.05
    while True:
        try:
            client.ping()
            return client
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
