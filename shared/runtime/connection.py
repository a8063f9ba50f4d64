"""Redis connections: one helper, password in the URL, wait instead of dying.

Under ``honcho start`` every process starts at once and one that exits stops
them all, so services wait for Redis to come up rather than fail.

A URL ``redis+cluster://[[user]:password@]host:port`` (or ``rediss+cluster://``) names a Redis Cluster by one of
its nodes: ``connect`` returns a ``redis.cluster.RedisCluster`` that finds the others and routes each command
to the shard of its key (keys.py lays keys out so that multi-key commands stay in one slot).
"""

from __future__ import annotations

import math
import time

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry


def _retry(seconds: float) -> dict:
    """Every command of a connected client retries through a server restart for about ``seconds`` (backoff
    from 0.05 s doubling to 1 s between tries), the AOF load after it (BUSY LOADING) included: a service
    waits for Redis instead of dying, and stops when it is really gone. (A client made by from_url otherwise
    gets no retries at all.)"""
    # 0.05 + 0.1 + 0.2 + 0.4 + 0.8 s, then 1 s apart
    tries = 5 + max(1, math.ceil(seconds - 1.55))
    return {
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), tries),
        "retry_on_error": [
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.BusyLoadingError,
        ],
    }


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(url: str) -> bool:
    """True when ``url`` names a Redis Cluster (``redis+cluster://host:port``)."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def is_cluster_client(client) -> bool:
    return isinstance(client, RedisCluster)


def _cluster(url: str, seconds: float | None, **kwargs) -> RedisCluster:
    """A cluster client from one node's URL. With ``seconds``, commands retry for about that long (the
    cluster client retries on connection errors and re-reads the slot map between tries)."""
    scheme, rest = url.split("://", 1)
    plain = f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}"
    if seconds is not None:
        kwargs = {"retry": _retry(seconds)["retry"], **kwargs}
    return RedisCluster.from_url(plain, **kwargs)


def connect(url: str, wait: float = 30.0, retry_for: float | None = None, **kwargs) -> redis.Redis:
    """A client once the server answers (waiting up to ``wait`` seconds for the first answer; a server
    still loading its data answers, so it is waited for); its commands retry for ``retry_for`` seconds
    (default ``wait``) when the server goes away. A ``redis+cluster://`` URL gives a ``RedisCluster``."""
    cluster = is_cluster(url)
    deadline = time.monotonic() + wait
    delay = 0.05
    while True:
        try:
            # the client reads the slot map on creation: it is the probe
            if cluster:
                client = _cluster(url, wait if retry_for is None else retry_for, **kwargs)
                client.ping()
                return client
            probe = redis.Redis.from_url(url, **kwargs)
            probe.ping()
            probe.close()
            return redis.Redis.from_url(
                url, health_check_interval=30, **{**_retry(wait if retry_for is None else retry_for), **kwargs}
            )
        except redis.exceptions.AuthenticationError:
            raise
        except (redis.exceptions.ConnectionError, redis.exceptions.RedisClusterException) as exc:
            if (
                isinstance(exc, redis.exceptions.AuthenticationError)
                or "invalid username-password" in str(exc)
                or "NOAUTH" in str(exc)
            ):
                raise redis.exceptions.AuthenticationError(str(exc)) from None
            # it answers: loading its data, not gone
            if isinstance(exc, redis.exceptions.BusyLoadingError):
                deadline = time.monotonic() + wait
            elif time.monotonic() > deadline:
                raise redis.exceptions.ConnectionError(
                    f"no Redis answering at {redact(url)} after {wait:g} s"
                ) from None
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
