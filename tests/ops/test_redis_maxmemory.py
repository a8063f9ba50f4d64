"""The embedded Redis's guard rail: with maxmemory set, a full server refuses writes (noeviction), and the error is
one recognisable line naming the config keys to change."""

from __future__ import annotations

import pytest
import redis

from services.ops.launch.redis_server import EmbeddedRedis
from shared.runtime.config.checks import validate
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.service import out_of_memory_line


def test_a_full_redis_refuses_writes_with_a_named_error(tmp_path):
    with EmbeddedRedis(tmp_path / "redis", maxmemory="3mb") as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):
                client.xadd("s", {"data": b"x" * 4096})
        # nothing evicted: every accepted entry is still there
        assert client.xlen("s") == i
        client.close()
    # the default: retention on
    line = out_of_memory_line(Config(redis_maxmemory="3mb"))
    assert line.startswith(
        "Redis is out of memory (maxmemory 3mb): raise redis_maxmemory or lower log_retention_versions (now 20"
    )
    line = out_of_memory_line(Config(redis_maxmemory="3mb", log_retention_versions=0))
    assert line.startswith(
        "Redis is out of memory (maxmemory 3mb): raise redis_maxmemory or set log_retention_versions"
    )


def test_redis_maxmemory_is_checked():
    validate(Config(redis_maxmemory="0"))
    with pytest.raises(ConfigError, match="redis_maxmemory.*512mb.*'lots'"):
        validate(Config(redis_maxmemory="lots"))
