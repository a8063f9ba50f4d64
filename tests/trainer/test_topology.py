"""The trainer's topology, chosen once (services/trainer/topology.py): alone unless torchrun started the process,
and a snapshot written by the other kind refused in one line."""

from __future__ import annotations

import pytest
import torch

from services.trainer import topology
from services.trainer.state import sharded, snapshot
from shared.runtime import logs
from shared.runtime.config.keys import Config


def test_alone_without_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    chosen = topology.choose(Config())
    assert isinstance(chosen, topology.Alone) and chosen.shard.main
    cfg, log = chosen.bind(Config(run="x"), "log")
    assert cfg.run == "x" and log == "log"


def test_alone_snapshots_in_the_background_loads_the_newest_and_refuses_a_sharded_one(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    alone = topology.Alone()
    landed = []
    snaps = snapshot.Snapshots(tmp_path, 2, 0.0, logs.get("snapshot-test"), on_landed=landed.append)
    alone.snapshot(snaps, model, opt, {"step": 4, "version": 2, "counts": {"x": 1}})
    taken = model.weight.detach().clone()
    # training goes on while the copy is written: the snapshot keeps the weights it was taken with
    with torch.no_grad():
        model.weight.add_(1.0)
    snaps.wait()
    alone.snapshot(snaps, model, opt, {"step": 8, "version": 4, "counts": {"x": 2}})
    snaps.close()
    # the older one pruned once the newer landed
    assert [p.name for p in (tmp_path / "snapshots").iterdir()] == ["v000004.pt"]
    assert [r["version"] for r in landed] == [2, 4] and not snaps.due(5) and snaps.due(6)
    other = torch.nn.Linear(3, 2)
    other_opt = torch.optim.AdamW(other.parameters())
    state = alone.load(tmp_path, other, other_opt)
    assert state["version"] == 4 and state["counts"] == {"x": 2} and torch.equal(other.weight, model.weight)
    assert not torch.equal(other.weight, taken) and other_opt.state_dict()["state"][0]["step"] == 1
    with pytest.raises(RuntimeError, match=r"holds a snapshots/ \(one process\) snapshot, which a trainer run as"):
        topology._refuse_the_other_kind(tmp_path, topology.Ranks.__new__(topology.Ranks))
    done = sharded.folder(tmp_path) / "v000002"
    done.mkdir(parents=True)
    (done / "meta.json").write_text("{}")
    (tmp_path / "snapshots" / "v000004.pt").unlink()
    with pytest.raises(RuntimeError, match=r"holds a dcp/ \(torchrun\) snapshot, which a trainer run as one process"):
        alone.load(tmp_path, other, torch.optim.AdamW(other.parameters()))


def test_a_snapshot_falls_due_once_a_restart_would_re_train_replay_s_but_never_below_its_own_cost_times_20(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    snaps = snapshot.Snapshots(tmp_path, 1000, 0.0, logs.get("snapshot-test"), replay_s=0.5)
    topology.Alone().snapshot(snaps, model, opt, {"step": 0, "version": 0, "counts": {}})
    snaps.wait()
    # its own cost measured (copy and write); then pinned, as the disk's speed is not this test's
    assert snaps.cost_s > 0
    snaps.wrote(0.01)
    snaps.trained(0.3)
    assert not snaps.due(1)
    snaps.trained(0.3)
    assert snaps.due(2)
    # a snapshot (taken or restored) starts the count again
    snaps.restored(2)
    assert snaps.trained_s == 0 and not snaps.due(3)
    # a snapshot that cost 0.1 s: the next one waits for 2 s of training, not 0.5
    snaps.wrote(0.1)
    snaps.trained(1.9)
    assert not snaps.due(4)
    snaps.trained(0.1)
    assert snaps.due(5)
    snaps.close()
    off = snapshot.Snapshots(tmp_path, 1000, 0.0, logs.get("snapshot-test"))
    off.restored(0)
    off.trained(1e6)
    assert not off.due(1)


def test_a_snapshots_cost_is_its_copy_and_its_writes_cpu_time_not_its_wait_on_a_slow_disk(tmp_path, monkeypatch):
    import os
    import time

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    landed = []
    snaps = snapshot.Snapshots(tmp_path, 1000, 0.0, logs.get("snapshot-test"), on_landed=landed.append, replay_s=0.1)
    real_fsync = os.fsync

    def slow_disk_fsync(fd):
        # a disk that takes 0.3 s to make a write durable: the writer waits, holding no core
        time.sleep(0.3)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_disk_fsync)
    topology.Alone().snapshot(snaps, model, opt, {"step": 0, "version": 0, "counts": {}})
    snaps.close()
    (record,) = landed
    assert record["seconds"] >= 0.6
    assert 0 < snaps.cost_s == record["cost_s"] < 0.1
    # so the next one falls due after replay_s (or COST_RATIO times the small cost) of training, not COST_RATIO
    # times the disk's wait: the copy and the CPU time vary with the box, the wait is what must not count
    falls_due_after = max(0.1, snapshot.COST_RATIO * snaps.cost_s)
    assert falls_due_after < snapshot.COST_RATIO * record["seconds"] / 4
    snaps.trained(falls_due_after * 0.9)
    assert not snaps.due(1)
    snaps.trained(falls_due_after * 0.2)
    assert snaps.due(1)


def test_weights_with_a_nan_or_an_infinity_anywhere_are_not_finite_and_huge_finite_ones_are():
    from services.trainer import distributed

    model = torch.nn.Linear(4, 3)
    assert distributed.all_finite(model, distributed.LOCAL)
    with torch.no_grad():
        # finite weights whose float32 sum overflows: checked element by element, still finite
        model.weight.fill_(3e38)
    assert distributed.all_finite(model, distributed.LOCAL)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with torch.no_grad():
            model.weight.fill_(0.5)
            model.bias[1] = bad
        assert not distributed.all_finite(model, distributed.LOCAL), bad
