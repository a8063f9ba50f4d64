"""The optional wandb sink, in offline mode (nothing leaves the machine)."""

from __future__ import annotations

import pytest

from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.config.sources import load
from shared.runtime.tensorboard import TensorBoard
from tests.support.procs import wait_until


def test_metrics_reach_an_offline_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = Config(run="wb", run_dir=str(tmp_path), wandb="offline")
    sink = TensorBoard(cfg, "trainer")
    sink.scalars("train", {"loss": 0.5, "staleness": {"0": 3}, "note": "text"}, step=1)
    sink.scalars("train", {"loss": 0.25}, step=2)
    sink.close()
    files = list((tmp_path / "wb" / "wandb").rglob("*.wandb"))
    assert len(files) == 1
    # wandb's service process writes the file after finish() returns
    data = wait_until(lambda: b"train/loss" in files[0].read_bytes() and files[0].read_bytes(), "wandb's file", 60)
    assert b"train/loss" in data and b"train/staleness/0" in data and b"train/note" not in data


def test_a_bad_wandb_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="config key 'wandb'"):
        load(env={}, overrides={"wandb": "yes"})
