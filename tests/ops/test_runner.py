"""`streamrl run` on a run folder: an ended run is moved aside, an interrupted one is continued."""

from __future__ import annotations

import uuid

from services.driver.driver import ENDED
from services.ops.launch.runner import archive_ended_run, processes
from shared.runtime.config.keys import Config


def test_ended_run_is_moved_aside_and_interrupted_run_is_kept(tmp_path):
    cfg = Config(run=f"archive{uuid.uuid4().hex[:8]}", run_dir=str(tmp_path / "runs"), weights_dir="")
    (cfg.run_path / "trainer").mkdir(parents=True)
    (cfg.run_path / "trainer" / "checkpoint.pt").write_bytes(b"x")
    assert archive_ended_run(cfg) is None and (cfg.run_path / "trainer" / "checkpoint.pt").exists()
    (cfg.run_path / ENDED).write_text("{}")
    dest = archive_ended_run(cfg)
    assert dest is not None and dest.name.startswith(f"{cfg.run}.") and (dest / "trainer" / "checkpoint.pt").exists()
    # its weights move with it: tests/ops/test_run_memory.py
    assert not cfg.run_path.exists()
    # nothing left to move
    assert archive_ended_run(cfg) is None


def test_processes_start_as_many_rollout_workers_as_configured():
    entries = {
        "redis": "exec streamrl redis",
        "rollout": "exec python -m services.rollout",
        "trainer": "exec python -m services.trainer",
        "agents": "exec python -m services.gateway.agents_worker",
    }
    started = processes(Config(rollout_workers=3, longtail_workers=1), entries)
    # no redis line,
    assert [name for name, _, _ in started] == ["rollout.1", "rollout.2", "rollout.3", "trainer"]
    # no agents without an agent
    assert [own for _, _, own in started] == [{}, {}, {"rollout_role": "longtail"}, {}]
    assert [n for n, _, _ in processes(Config(), entries)] == ["rollout", "trainer"]
    assert [n for n, _, _ in processes(Config(agent="m:f", agent_workers=2), entries)] == [
        "rollout",
        "trainer",
        "agents.1",
        "agents.2",
    ]


def test_a_reader_gone_away_silences_the_run_and_the_processes_still_end_with_it():
    """`streamrl run | head`: honcho's own printer raised BrokenPipeError out of its loop, which then neither
    supervised nor stopped the processes (they ran on; SIGINT/SIGTERM no longer reached them)."""
    import os

    from honcho.manager import Manager

    from services.ops.launch.runner import LinePrinter

    read_end, write_end = os.pipe()
    # the reader is gone before the first line
    os.close(read_end)
    out = os.fdopen(write_end, "w")
    manager = Manager(printer=LinePrinter(out))
    manager.add_process("talker", "echo one; echo two; exit 3")
    manager.add_process("sleeper", "sleep 30")
    # returns once every process stopped: the talker's exit ends the sleeper, as in a run
    manager.loop()
    out.close()
    assert manager.returncode == 3
    assert all(p.get("returncode") is not None for p in manager._processes.values())


def test_a_redis_url_at_another_address_is_the_users_own_server(monkeypatch):
    from services.ops.launch.runner import own_server

    monkeypatch.delenv("REDIS_URL", raising=False)
    # the default: the embedded server, on a free port
    assert not own_server(Config())
    # the embedded server's password
    assert not own_server(Config(redis_url="redis://:s3cret@127.0.0.1:6390/0"))
    # `--redis-url`: that server, used as it is
    assert own_server(Config(redis_url="redis://127.0.0.1:6417/0"))
    assert own_server(Config(redis_url="redis+cluster://10.0.0.5:7000"))
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6390/0")
    assert own_server(Config())


def test_the_users_own_server_must_answer_before_anything_starts(redis_url):
    import socket

    import pytest

    from services.ops.launch.runner import reachable
    from shared.runtime.config.errors import ConfigError

    # the session's server answers
    reachable(redis_url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        # nothing listens there once the socket closes
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"redis_url.*127\.0\.0\.1:{port}.*embedded server") as err:
        reachable(f"redis://:s3cret@127.0.0.1:{port}/0", wait=0.5)
    assert "s3cret" not in str(err.value)
