"""`streamrl run` on a run folder: an ended run is moved aside, an interrupted one is continued."""

from __future__ import annotations

import uuid

from shared.runtime.config import Config
from services.driver.driver import ENDED
from services.ops.runner import archive_ended_run, processes


def test_ended_run_is_moved_aside_and_interrupted_run_is_kept(tmp_path):
    cfg = Config(run=f"archive{uuid.uuid4().hex[:8]}", run_dir=str(tmp_path / "runs"), weights_dir="")
    (cfg.run_path / "trainer").mkdir(parents=True)
    (cfg.run_path / "trainer" / "checkpoint.pt").write_bytes(b"x")
    assert archive_ended_run(cfg) is None and (cfg.run_path / "trainer" / "checkpoint.pt").exists()
    (cfg.run_path / ENDED).write_text("{}")
    dest = archive_ended_run(cfg)
    assert dest is not None and dest.name.startswith(f"{cfg.run}.") and (dest / "trainer" / "checkpoint.pt").exists()
    assert not cfg.run_path.exists()  # its weights move with it: tests/ops/test_run_memory.py
    assert archive_ended_run(cfg) is None  # nothing left to move


def test_processes_start_as_many_rollout_workers_as_configured():
    entries = {"redis": "exec streamrl redis", "rollout": "exec python -m services.rollout",
               "trainer": "exec python -m services.trainer", "agents": "exec python -m services.gateway.agents_worker"}
    started = processes(Config(rollout_workers=3, longtail_workers=1), entries)
    assert [name for name, _, _ in started] == ["rollout.1", "rollout.2", "rollout.3", "trainer"]  # no redis line,
    assert [own for _, _, own in started] == [{}, {}, {"rollout_role": "longtail"}, {}]  # no agents without an agent
    assert [n for n, _, _ in processes(Config(), entries)] == ["rollout", "trainer"]
    assert [n for n, _, _ in processes(Config(agent="m:f", agent_workers=2), entries)] == [
        "rollout", "trainer", "agents.1", "agents.2"]
