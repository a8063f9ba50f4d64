"""The trainer's topology, chosen once (services/trainer/topology.py): alone unless torchrun started the process,
and a checkpoint written by the other kind refused in one line."""

from __future__ import annotations

import pytest
import torch

from services.trainer import checkpoint, sharded_checkpoint, topology
from shared.runtime.config.keys import Config


def test_alone_without_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    chosen = topology.choose(Config())
    assert isinstance(chosen, topology.Alone) and chosen.shard.main
    cfg, log = chosen.bind(Config(run="x"), "log")
    assert cfg.run == "x" and log == "log"


def test_alone_saves_and_loads_its_checkpoint_and_refuses_a_sharded_one(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    alone = topology.Alone()
    meta = {"step": 4, "version": 2, "counts": {}, "ledger_record": {}}
    alone.save(tmp_path, model, opt, meta)
    checkpoint.wait()
    other = torch.nn.Linear(3, 2)
    state = alone.load(tmp_path, other, torch.optim.AdamW(other.parameters()))
    assert state["version"] == 2 and torch.equal(other.weight, model.weight)
    done = sharded_checkpoint.folder(tmp_path) / "v000002"
    done.mkdir(parents=True)
    (done / "meta.json").write_text("{}")
    (tmp_path / "checkpoint.pt").unlink()
    with pytest.raises(RuntimeError, match=r"holds a dcp/ \(torchrun\) checkpoint, which a trainer run as one process"):
        alone.load(tmp_path, other, torch.optim.AdamW(other.parameters()))
