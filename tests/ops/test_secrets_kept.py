"""Secrets stay secret: `streamrl config` redacts them, run folders are 0700 and checkpoints 0600 and loaded
without pickle code, the weight server serves no symlink out of its folder, agent jobs carry no key."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import httpx
import pytest
import torch

from services.driver.agents import group_specs
from services.trainer.state import snapshot
from shared.runtime import logs, runstate, secrets
from shared.runtime.config.keys import Config
from shared.runtime.weights.server import WeightServer, file_name
from tests.support.procs import ROOT


def _config(*args: str, env: dict | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "config", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_streamrl_config_redacts_secrets_unless_asked(tmp_path):
    run_dir = str(tmp_path / "runs")
    made = secrets.load_or_create(tmp_path / "runs" / "r", {"redis_server": "127.0.0.1:6390"})
    env = {"STREAMRL_WEIGHTS_TOKEN": "tok-given"}
    text = _config("--run", "r", "--run-dir", run_dir, env=env)
    for value in (made["gateway_api_key"], made["redis_password"], "tok-given"):
        assert value not in text
    # where it came from is shown
    assert 'gateway_api_key = "***"' in text and "secrets.json" in text
    assert "redis://:***@127.0.0.1:6390/0" in text
    shown = json.loads(_config("--run", "r", "--run-dir", run_dir, "--json", "--show-secrets", env=env))
    assert shown["gateway_api_key"]["value"] == made["gateway_api_key"]
    assert shown["weights_token"]["value"] == "tok-given"


def test_run_folder_0700_snapshot_0600_loaded_without_pickle_code(tmp_path, client, keys):
    run_path = tmp_path / "runs" / keys.run
    runstate.bind(client, keys, run_path, "redis://127.0.0.1:1/0")
    assert stat.S_IMODE(run_path.stat().st_mode) == 0o700
    model = torch.nn.Linear(2, 2)
    snaps = snapshot.Snapshots(run_path / "trainer", 1, 0.0, logs.get("secrets-test"))
    snaps.take(1, 1, model, torch.optim.AdamW(model.parameters()), {})
    snaps.close()
    assert stat.S_IMODE(snapshot.file_of(run_path / "trainer", 1).stat().st_mode) == 0o600
    assert snapshot.load(run_path / "trainer")["version"] == 1

    # what a pickle-code snapshot does on load: call anything
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"x": Evil(), "version": 2}, snapshot.file_of(run_path / "trainer", 2))
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        snapshot.load(run_path / "trainer")
    assert not (tmp_path / "pwned").exists()


def test_the_weight_server_refuses_a_symlink_out_of_its_folder(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    (tmp_path / "private.key").write_text("secret")
    os.symlink(tmp_path / "private.key", folder / file_name(3))
    (folder / file_name(4)).write_bytes(b"weights")
    srv = WeightServer(folder).start()
    try:
        assert httpx.get(srv.url_of(3)).status_code == 404
        assert httpx.get(srv.url_of(4)).content == b"weights"
    finally:
        srv.stop()


def test_agent_jobs_carry_no_gateway_key():
    cfg = Config(agent="examples.calc:agent", gateway_api_key="the-gateway-key")
    specs = group_specs(cfg, "g", {"prompt": "1+1=", "answer": "2"}, 2)
    assert all("the-gateway-key" not in json.dumps(s) for s in specs)
