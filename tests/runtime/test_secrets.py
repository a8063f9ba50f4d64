"""The run's secrets file (shared/runtime/secrets.py) and the embedded Redis started with the run's password."""

from __future__ import annotations

import os
import stat
import subprocess
import uuid

import pytest
import redis

from services.ops.launch.redis_server import start_for_run
from shared.runtime import secrets
from shared.runtime.config import sources as config_sources
from shared.runtime.config.keys import Config


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_fill_gives_the_password_only_to_its_own_server():
    data = {"redis_password": "pw", "redis_server": "127.0.0.1:7001", "gateway_api_key": "gk", "weights_token": "wt"}
    got = secrets.fill({"redis_url": "redis://127.0.0.1:7001/0", "gateway_api_key": "", "weights_token": ""}, data)
    assert got == {"redis_url": "redis://:pw@127.0.0.1:7001/0", "gateway_api_key": "gk", "weights_token": "wt"}
    # another server (your own Redis without a password) gets none; values given stay
    assert secrets.fill({"redis_url": "redis://127.0.0.1:7002/0", "gateway_api_key": "mine"}, data) == {
        "weights_token": "wt"
    }
    assert secrets.fill({"redis_url": "redis://:own@127.0.0.1:7001/0"}, data) == {
        "gateway_api_key": "gk",
        "weights_token": "wt",
    }


def test_secrets_file_is_made_0600_in_a_0700_folder_and_keeps_what_was_given(tmp_path):
    run_path = tmp_path / "runs" / "r"
    first = secrets.load_or_create(run_path, {"gateway_api_key": "given"})
    assert first["gateway_api_key"] == "given" and len(first["redis_password"]) >= 32 and first["weights_token"]
    assert _mode(secrets.path(run_path)) == 0o600 and _mode(run_path) == 0o700
    again = secrets.load_or_create(run_path)
    # the same secrets on every start
    assert again == first
    assert secrets.read(tmp_path / "nowhere") == {}


def test_config_redaction_helpers_and_episode_keys():
    assert secrets.without_password("redis://:pw@127.0.0.1:1/0") == "redis://127.0.0.1:1/0"
    assert secrets.with_password("redis://127.0.0.1:1/0", "p/w") == "redis://:p%2Fw@127.0.0.1:1/0"
    a, b = secrets.episode_key("key", "g1-0"), secrets.episode_key("key", "g1-1")
    assert a != b and a == secrets.episode_key("key", "g1-0") and "key" not in a
    assert secrets.same(a, a) and not secrets.same(a, b)


def test_the_runs_redis_asks_for_the_runs_password_and_every_process_finds_it(tmp_path):
    cfg = Config(run=f"sec{uuid.uuid4().hex[:6]}", run_dir=str(tmp_path / "runs"))
    server = start_for_run(cfg)
    try:
        # a local user without the file
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host=server.host, port=server.port).ping()
        argv = subprocess.run(["ps", "-o", "args=", "-p", str(server.proc.pid)], capture_output=True, text=True).stdout
        # not on the command line
        assert server.password not in argv and server.port
        # a process of the run: REDIS_URL without a password, run_dir and run: the secrets file fills it in
        env = {
            "REDIS_URL": secrets.without_password(server.url),
            "STREAMRL_RUN": cfg.run,
            "STREAMRL_RUN_DIR": cfg.run_dir,
        }
        loaded, sources = config_sources.load_with_sources(env=env)
        assert redis.Redis.from_url(loaded.redis_url).ping()
        assert loaded.gateway_api_key and loaded.weights_token and "secrets.json" in sources["gateway_api_key"]
        assert _mode(cfg.run_path / "redis") == 0o700
    finally:
        server.stop()
    # a password of your own in redis_url is the server's password
    own = start_for_run(cfg.replace(run=cfg.run + "b", redis_url="redis://:mine@127.0.0.1:6390/0"))
    try:
        assert own.password == "mine" and redis.Redis(port=own.port, password="mine").ping()
    finally:
        own.stop()
