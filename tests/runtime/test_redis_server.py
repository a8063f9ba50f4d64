import os

import pytest
import redis

from services.ops.launch.redis_server import EmbeddedRedis, ServerError
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import Keys
from shared.runtime.connection import connect, redact
from tests.support.procs import wait_until


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); its state letter says otherwise
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[1].split()[0] != "Z"


def test_start_and_stop_leave_no_process(tmp_path):
    server = EmbeddedRedis(tmp_path).start()
    pid, url = server.proc.pid, server.url
    assert connect(url).ping()
    server.stop()
    assert not _alive(pid)
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()


def test_binds_loopback_with_aof_everysec(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        c = connect(server.url)
        assert c.config_get("appendonly")["appendonly"] == "yes"
        assert c.config_get("appendfsync")["appendfsync"] == "everysec"
        assert c.config_get("bind")["bind"].split()[0] == "127.0.0.1"


def test_password_in_url(tmp_path):
    with EmbeddedRedis(tmp_path, password="s3cret") as server:
        assert ":s3cret@" in server.url and "s3cret" not in redact(server.url)
        assert connect(server.url).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host=server.host, port=server.port).ping()


def test_port_in_use_is_a_clear_error(tmp_path):
    with EmbeddedRedis(tmp_path / "a") as first:
        with pytest.raises(ServerError, match=f"port {first.port}"):
            EmbeddedRedis(tmp_path / "b", port=first.port).start(timeout=5)


def test_flushed_events_survive_a_server_kill_9(tmp_path):
    """A crash of the server process (kill -9) loses no acknowledged write: the append-only file holds it.
    This cannot tell ``appendfsync everysec`` from ``no`` (after a process crash the page cache still has the
    writes): that the fsync policy is everysec is test_binds_loopback_with_aof_everysec's job, and losing
    the last second of an OS crash is the AOF-cut drill in test_faults.py."""
    server = EmbeddedRedis(tmp_path).start()
    keys = Keys("aof")
    log = EpisodeLog(connect(server.url), keys, "w")
    log.open("e1")
    log.append("e1", "started", {"episode_id": "e1", "group_id": "g", "index": 0, "prompt_ids": [1], "sampling": {}}, 0)
    log.append_tokens("e1", list(range(100)), [0.0] * 100, 0)
    log.flush_or_raise()
    port = server.port
    server.kill()
    restarted = EmbeddedRedis(tmp_path, port=port).start()
    try:
        ep = EpisodeLog(connect(restarted.url), keys, "w").replay("e1")
        assert ep.tokens == list(range(100))
    finally:
        restarted.stop()


def test_drain_waits_for_clients_to_leave_then_returns(tmp_path):
    """Under honcho every process gets SIGTERM at once: `streamrl redis` drains before it stops. A client
    still connected at the end of the grace is counted; one that writes its last events while the server
    drains and then leaves ends the drain at once (long before its 600-s grace)."""
    import threading

    from services.ops.launch.redis_server import DRAIN_CLIENT

    with EmbeddedRedis(tmp_path) as server:
        client = connect(server.url)
        # a connection is open
        client.ping()
        # a client stayed
        assert server.drain(0.3) == 1

        result = {}
        drainer = threading.Thread(target=lambda: result.update(left=server.drain(600)), daemon=True)
        drainer.start()
        wait_until(lambda: any(c.get("name") == DRAIN_CLIENT for c in client.client_list()), "the drain under way", 30)
        # a service flushing after the SIGTERM
        client.xadd("last-words", {"k": "v"})
        client.close()
        drainer.join(60)
        # returned when the client left, not after the grace
        assert not drainer.is_alive() and result["left"] == 0
        assert connect(server.url).xlen("last-words") == 1
