"""Trainer: batches equal the streams, versions are published, exactly-once across kill -9."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import torch

from services.trainer import checkpoint
from shared.protocol.ledger import read_ledger
from services.trainer.batch import build_batch
from services.trainer.publish import sha256
from services.trainer.trainer import Trainer
from shared.runtime import logs
from shared.runtime.config import Config
from shared.protocol.episode_log import EpisodeLog
from shared.protocol.fold import fold
from tests.helpers import finished, raw, started, tokens
from shared.protocol.keys import TRAINER_GROUP
from shared.protocol import samples
from shared.protocol import versions as pversions


def _write_group(client, keys, group_id: str, n: int = 2, version: int = 0, rng=None, length: int = 6) -> None:
    rng = rng or random.Random(group_id)
    log = EpisodeLog(client, keys, "writer")
    eids = []
    for i in range(n):
        eid = f"{group_id}-{i}"
        eids.append(eid)
        log.open(eid)
        log.append(eid, "started", {"episode_id": eid, "group_id": group_id, "index": i,
                                    "prompt_ids": [rng.randrange(3, 90) for _ in range(4)],
                                    "sampling": {"temperature": 1.0}, "task": {}}, version)
        ids = [rng.randrange(3, 90) for _ in range(length)]
        log.append_tokens(eid, ids, [-rng.random() * 4 for _ in ids], version)
        log.append(eid, "finished", {"reason": "stop", "reward": float(i == 0)}, version)
    log.flush_or_raise()
    client.xadd(keys.samples, samples.encode(samples.Sample(group_id, eids, "writer", n)))


def _cfg(keys, model_dir, tmp_path, **kw) -> Config:
    base = dict(run=keys.run, model_dir=model_dir, run_dir=str(tmp_path / "runs"),
                weights_dir=str(tmp_path / "weights"), batch_groups=2, steps_per_version=1, lr=1e-3)
    return Config(**{**base, **kw})


def test_batch_positions_match_the_stream():
    evs = [started(prompt=(5, 6, 7)), tokens(1, [10, 11], logprobs=[-0.5, -1.5]),
           finished(2)]
    ep = fold(raw(evs))
    ep.mask[1] = 0  # pretend the second token came from a tool
    b = build_batch([[ep]], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 10, 11]]
    # logits at position t predict input t+1: response tokens are targets 2 and 3
    assert b.targets.tolist() == [[6, 7, 10, 11]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 0]]
    assert b.behav_logp.tolist() == [[0, 0, -0.5, -1.5]]
    assert b.versions.tolist() == [[-1, -1, 0, 0]]


def test_trains_publishes_and_acks(client, keys, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    for g in ("a", "b", "c", "d"):
        _write_group(client, keys, g)
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stop_after = {"versions": 2}
    trainer.run(should_stop=lambda: trainer.version >= stop_after["versions"])
    versions = pversions.read_all(client, keys)
    assert [v.version for v in versions] == [1, 2]
    for v in versions:
        assert sha256(__import__("pathlib").Path(v.path)) == v.sha256
    assert client.xpending(keys.samples, TRAINER_GROUP)["pending"] == 0
    ledger = read_ledger(cfg.run_path / "trainer")
    assert sorted(g for rec in ledger for g in rec["groups"]) == ["a", "b", "c", "d"]
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    lines = [json.loads(x) for x in (cfg.run_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and {"reward_mean", "clip_fraction", "entropy", "staleness"} <= set(lines[0])


def test_too_stale_group_is_not_trained_but_stays_in_its_stream(client, keys, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path, batch_groups=1, max_staleness=1)
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    trainer.version = 3  # as if three versions had been published
    _write_group(client, keys, "old", version=1)
    _write_group(client, keys, "fresh", version=2)
    trainer.restore()
    groups = trainer.collect(lambda: False)
    assert [g for _, g, _ in groups] == ["fresh"]
    assert trainer.stale_dropped == 1
    assert EpisodeLog(client, keys, "r").replay("old-0").status == "finished"


def test_only_stale_groups_are_acknowledged_without_a_training_step(client, keys, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path, batch_groups=2, max_staleness=0)
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    trainer.version = 2
    _write_group(client, keys, "old1", version=0)
    _write_group(client, keys, "old2", version=1)
    trainer.restore()
    calls = iter(range(100))
    assert trainer.collect(lambda: next(calls) > 5) is None
    assert client.xpending(keys.samples, TRAINER_GROUP)["pending"] == 0
    ledger = read_ledger(cfg.run_path / "trainer")
    assert [rec["skipped"] for rec in ledger] == [["old1", "old2"]] and ledger[0]["groups"] == []
    assert trainer.step == 0


def _trainer_proc(redis_url, cfg: Config):
    args = [sys.executable, "-m", "services.trainer", "--run", cfg.run, "--redis-url", redis_url,
            "--model-dir", cfg.model_dir, "--run-dir", cfg.run_dir, "--weights-dir", cfg.weights_dir,
            "--batch-groups", "2", "--steps-per-version", "2", "--max-staleness", "100", "--log-level", "warning"]
    return subprocess.Popen(args, start_new_session=True)


def test_kill_9_trains_every_sample_exactly_once(client, keys, redis_url, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    groups = [f"g{i:02d}" for i in range(24)]
    for g in groups[:12]:
        _write_group(client, keys, g, length=40)
    proc = _trainer_proc(redis_url, cfg)
    ledger_dir = cfg.run_path / "trainer"
    try:
        deadline = time.monotonic() + 120
        while len(read_ledger(ledger_dir)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(random.Random(1).random() * 0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for g in groups[12:]:
        _write_group(client, keys, g, length=40)
    proc = _trainer_proc(redis_url, cfg)
    try:
        deadline = time.monotonic() + 180
        while True:
            done = [g for rec in read_ledger(ledger_dir) for g in rec["groups"] + rec["skipped"]]
            if len(set(done)) == len(groups):
                break
            assert time.monotonic() < deadline, f"only {len(set(done))} groups committed"
            assert proc.poll() is None
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)
    trained = [g for rec in read_ledger(ledger_dir) for g in rec["groups"]]
    assert sorted(trained) == groups  # every group trained, none twice
    versions = [v.version for v in pversions.read_all(client, keys)]
    assert versions == sorted(set(versions)) and versions[-1] == len(groups) // 4
