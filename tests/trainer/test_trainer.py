"""Trainer: batches equal the streams, versions are published, exactly-once across kill -9."""

from __future__ import annotations

import json
import os
import random
import signal
import threading

import pytest
import torch

from services.ops.check.checker import check, read_run
from services.trainer.batch import build_batch
from services.trainer.publish import sha256
from services.trainer.trainer import Trainer
from shared.protocol.archive.ledger import last_commit, read_ledger, read_replays
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import TRAINER_GROUP
from shared.protocol.streams import dead_letters, samples
from shared.protocol.streams import versions as pversions
from shared.runtime import faults, logs
from shared.runtime.config.keys import Config
from shared.runtime.weights import chain
from tests.support.helpers import finished, raw, started, tokens
from tests.support.procs import kill9, spawn, stop, wait_until


def _write_group(
    client, keys, group_id: str, n: int = 2, version: int = 0, rng=None, length: int = 6, rewards=None, logprob=None
) -> None:
    rng = rng or random.Random(group_id)
    log = EpisodeLog(client, keys, "writer")
    eids = []
    for i in range(n):
        eid = f"{group_id}-{i}"
        eids.append(eid)
        log.open(eid)
        log.append(
            eid,
            "started",
            {
                "episode_id": eid,
                "group_id": group_id,
                "index": i,
                "prompt_ids": [rng.randrange(3, 90) for _ in range(4)],
                "sampling": {"temperature": 1.0},
                "task": {},
            },
            version,
        )
        ids = [rng.randrange(3, 90) for _ in range(length)]
        log.append_tokens(eid, ids, [-rng.random() * 4 if logprob is None else logprob for _ in ids], version)
        reward = float(i == 0) if rewards is None else rewards[i]
        log.append(eid, "finished", {"reason": "stop", "reward": reward}, version)
    log.flush_or_raise()
    client.xadd(keys.samples, samples.encode(samples.Sample(group_id, eids, "writer", n)))


def _cfg(keys, model_dir, tmp_path, **kw) -> Config:
    base = dict(
        run=keys.run,
        model_dir=model_dir,
        run_dir=str(tmp_path / "runs"),
        weights_dir=str(tmp_path / "weights"),
        batch_groups=2,
        steps_per_version=1,
        lr=1e-3,
        # snapshots by versions only, where a test counts what a restore re-trains
        snapshot_replay_s=0.0,
    )
    return Config(**{**base, **kw})


def test_batch_positions_match_the_stream():
    evs = [started(prompt=(5, 6, 7)), tokens(1, [10, 11], logprobs=[-0.5, -1.5]), finished(2)]
    ep = fold(raw(evs))
    # pretend the second token came from a tool
    ep.mask[1] = 0
    b = build_batch([[ep]], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 10, 11]]
    # logits at position t predict input t+1: response tokens are targets 2 and 3
    assert b.targets.tolist() == [[6, 7, 10, 11]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 0]]
    assert b.behav_logp.tolist() == [[0, 0, -0.5, -1.5]]
    assert b.versions.tolist() == [[-1, -1, 0, 0]]


def test_trains_publishes_and_acks(client, keys, tiny_model_dir, tmp_path):
    # bf16 at a low learning rate: most elements keep their bits, so version 2 is published as its delta
    cfg = _cfg(keys, tiny_model_dir, tmp_path, publish_dtype="bfloat16", lr=1e-5)
    for g in ("a", "b", "c", "d"):
        _write_group(client, keys, g)
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stop_after = {"versions": 2}
    trainer.run(should_stop=lambda: trainer.version >= stop_after["versions"])
    versions = pversions.read_all(client, keys)
    assert [v.version for v in versions] == [1, 2]
    # v1 a full file (the first), v2 its delta: the file the event names is made from the chain, bit-exact
    folder = tmp_path / "weights"
    assert (folder / "v000001.safetensors").is_file() and (folder / "v000002.delta").is_file()
    assert not (folder / "v000002.safetensors").exists()
    for v in versions:
        assert sha256(chain.make(folder, v.version)) == v.sha256
    assert client.xpending(keys.samples, TRAINER_GROUP)["pending"] == 0
    ledger = read_ledger(cfg.run_path / "trainer")
    assert sorted(g for rec in ledger for g in rec["groups"]) == ["a", "b", "c", "d"]
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    lines = [json.loads(x) for x in (cfg.run_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and {"reward_mean", "clip_fraction", "entropy", "staleness"} <= set(lines[0])


def test_a_stale_group_trains_and_tokens_past_the_hard_limit_are_masked_and_counted(
    client, keys, tiny_model_dir, tmp_path
):
    cfg = _cfg(keys, tiny_model_dir, tmp_path, batch_groups=2, max_staleness=1, hard_max_staleness=2)
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    # as if four versions had been published
    trainer.version = 4
    # 3 behind: past the hard limit
    _write_group(client, keys, "old", version=1)
    # 2 behind: past max_staleness, trained with its IS weight
    _write_group(client, keys, "stale", version=2)
    trainer.restore()
    groups = trainer.collect(lambda: False)
    # finished groups are not thrown away
    assert [g for _, g, _ in groups] == ["old", "stale"]
    metrics = trainer.train_step(groups)
    # 2 episodes x 6 tokens of "old"
    assert metrics["stale_tokens_masked"] == 12 and metrics["tokens"] == 12
    assert metrics["tokens_wasted"] == 12 and metrics["groups_dropped"] == 0


def test_untrainable_groups_are_acknowledged_without_a_training_step(client, keys, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path, batch_groups=2, filter_constant_groups=True)
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    _write_group(client, keys, "same1", rewards=[1.0, 1.0])
    _write_group(client, keys, "same2", rewards=[0.0, 0.0])
    trainer.restore()
    calls = iter(range(100))
    assert trainer.collect(lambda: next(calls) > 5) is None
    assert client.xpending(keys.samples, TRAINER_GROUP)["pending"] == 0
    ledger = read_ledger(cfg.run_path / "trainer")
    assert [rec["skipped"] for rec in ledger] == [["same1", "same2"]] and ledger[0]["groups"] == []
    assert trainer.step == 0 and trainer.counts["constant_groups_filtered"] == 2
    # both gave their gate slot back
    assert int(client.get(keys.gate_started) or 0) == -2


def test_pending_entries_past_one_page_are_all_reread_after_a_restart(client, keys, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    for i in range(150):
        client.xadd(keys.samples, {"group_id": f"p{i:03d}", "episodes": f"p{i:03d}-0"})
    first = Trainer(cfg, client, logs.get("trainer-test"))
    first.restore()
    # delivered to the trainer, never acknowledged: a crash here
    while first.intake.read() is not None:
        pass
    assert client.xpending(keys.samples, TRAINER_GROUP)["pending"] == 150
    again = Trainer(cfg, client, logs.get("trainer-test"))
    again.restore()
    assert sorted(g for _, g, _ in again.intake.buffer) == [f"p{i:03d}" for i in range(150)]


def test_a_non_finite_step_is_skipped_counted_and_never_published(client, keys, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path, batch_groups=1)
    _write_group(client, keys, "nan", logprob=float("nan"))
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.run(should_stop=lambda: trainer.version >= 1)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    line = json.loads((cfg.run_path / "metrics.jsonl").read_text().splitlines()[0])
    # both minibatches (ppo_minibatches = 2)
    assert line["nonfinite_skipped"] == 2 and line["ppo_steps"] == 0
    (line,) = read_ledger(cfg.run_path / "trainer")
    assert {k: line[k] for k in ("commit", "step", "groups", "skipped", "batches")} == {
        "commit": 1,
        "step": 1,
        "groups": [],
        "skipped": ["nan"],
        "batches": [[["nan", 2]]],
    }
    assert line["counts"]["nonfinite_skipped"] == 2


def _trainer_proc(
    redis_url,
    cfg: Config,
    crash_at: str | None = None,
    nth: int = 1,
    snapshot_every: int = 2,
    batch_groups: int = 2,
    steps_per_version: int = 2,
):
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    if crash_at:
        # the trainer kills itself there, the nth time it passes (shared/runtime/faults.py)
        env.update(faults.spec("trainer", crash_at, nth))
    return spawn(
        "services.trainer",
        "--run",
        cfg.run,
        "--redis-url",
        redis_url,
        "--model-dir",
        cfg.model_dir,
        "--run-dir",
        cfg.run_dir,
        "--weights-dir",
        cfg.weights_dir,
        "--batch-groups",
        str(batch_groups),
        "--steps-per-version",
        str(steps_per_version),
        "--snapshot-every-versions",
        str(snapshot_every),
        "--snapshot-replay-s",
        "0",
        "--max-staleness",
        "100",
        "--log-level",
        "warning",
        env=env,
    )


def _committed(ledger_dir) -> set[str]:
    return {g for rec in read_ledger(ledger_dir) for g in rec["groups"] + rec["skipped"]}


@pytest.mark.slow
def test_kill_9_trains_every_sample_exactly_once(client, keys, redis_url, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    groups = [f"g{i:02d}" for i in range(24)]
    for g in groups[:12]:
        _write_group(client, keys, g, length=40)
    # killed mid-step while it holds delivered groups it has not committed: they must come back to it. The trainer
    # kills itself after its fifth step (a commit is 2 steps of 2 groups) rather than when a poll sees that state:
    # under load a poll can miss the window between two commits.
    proc = _trainer_proc(redis_url, cfg, crash_at="stepped", nth=5)
    ledger_dir = cfg.run_path / "trainer"
    try:
        assert proc.wait(180) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            kill9(proc)
    assert len(read_ledger(ledger_dir)) == 2 and len(_committed(ledger_dir)) == 8
    # the fifth step's two groups at least: delivered, trained into the model, never acknowledged
    assert client.xpending(keys.samples, TRAINER_GROUP)["pending"] >= 2
    for g in groups[12:]:
        _write_group(client, keys, g, length=40)
    proc = _trainer_proc(redis_url, cfg)
    try:
        wait_until(lambda: len(_committed(ledger_dir)) == len(groups), "every group committed", 180, [proc])
    finally:
        stop(proc)
    trained = [g for rec in read_ledger(ledger_dir) for g in rec["groups"]]
    # every group trained, none twice
    assert sorted(trained) == groups
    versions = [v.version for v in pversions.read_all(client, keys)]
    assert versions == sorted(set(versions)) and versions[-1] == len(groups) // 4


def _finish(client, keys, ledger_dir, groups: list[str], proc, timeout: float) -> int:
    """Until ``proc`` (a trainer) has committed every group and published its last version, then stop it; that
    version."""
    try:
        wait_until(
            lambda: (
                _committed(ledger_dir) == set(groups) and client.xpending(keys.samples, TRAINER_GROUP)["pending"] == 0
            ),
            "every group committed",
            timeout,
            [proc],
        )
        last = last_commit(read_ledger(ledger_dir))
        wait_until(lambda: pversions.latest_number(client, keys) >= last, "the last version published", 60, [proc])
    finally:
        stop(proc)
    return last


def _trainer_thread(cfg: Config, client):
    """A real Trainer.run loop in a thread; returns (trainer, stop): call stop() to end it."""
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    done = threading.Event()
    thread = threading.Thread(target=trainer.run, kwargs={"should_stop": done.is_set}, daemon=True)
    thread.start()

    def stop_it():
        done.set()
        thread.join(60)

    return trainer, stop_it


def test_an_idle_trainer_publishes_again_a_version_redis_lost_and_keeps_only_weights_a_worker_may_load(
    client, keys, tiny_model_dir, tmp_path
):
    # a worker may still load the last 3 versions; a full file every 2 versions, deltas between (bf16, low lr)
    cfg = _cfg(keys, tiny_model_dir, tmp_path, max_staleness=0, publish_full_every=2, publish_dtype="bfloat16", lr=1e-5)
    for i in range(8):
        _write_group(client, keys, f"w{i}")
    trainer, stop_it = _trainer_thread(cfg, client)
    try:
        wait_until(lambda: pversions.latest_number(client, keys) == 4, "version 4 published", 120)
        folder = tmp_path / "weights"
        files = lambda: sorted(p.name for p in folder.glob("v*"))  # noqa: E731
        # the prune follows the publish: wait for it rather than read the folder at the publish's instant
        wait_until(lambda: "v000001.safetensors" not in files(), "version 1's weights pruned", 30)
        # v2 the base every version a worker may load is made from (v3 from its delta)
        assert files() == ["v000002.safetensors", "v000003.delta", "v000004.safetensors"]
        assert all(chain.can_make(folder, v) for v in (2, 3, 4))
        newest = pversions.latest(client, keys)
        # a Redis restart lost its last second: the event is gone
        client.xdel(keys.versions, newest.entry_id)
        assert pversions.latest_number(client, keys) == 3
        wait_until(lambda: pversions.latest_number(client, keys) == 4, "version 4 published again", 30)
        again = pversions.latest(client, keys)
        assert (again.path, again.sha256, again.step) == (newest.path, newest.sha256, newest.step)
        # the same file, not a new version
        assert trainer.version == 4
    finally:
        stop_it()


def test_an_unreadable_episode_stream_is_dead_lettered_and_its_group_trains_without_it(
    client, keys, tiny_model_dir, tmp_path
):
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    for g in ("u1", "u2", "u3", "u4", "u5"):
        _write_group(client, keys, g)
    bad = {
        eid: client.xadd(keys.episode(eid), {"type": "tokens", "v": "2", "seq": "x"}).decode()
        # u1 keeps one readable episode; u3 has none
        for eid in ("u1-1", "u3-0", "u3-1")
    }
    trainer, stop_it = _trainer_thread(cfg, client)
    try:
        wait_until(
            lambda: _committed(cfg.run_path / "trainer") == {"u1", "u2", "u3", "u4", "u5"}, "every group committed", 120
        )
    finally:
        stop_it()
    records = read_ledger(cfg.run_path / "trainer")
    assert sorted(g for r in records for g in r["groups"]) == ["u1", "u2", "u4", "u5"]
    assert [g for r in records for g in r["skipped"]] == ["u3"]
    letters = {(d.stream, d.entry) for d in dead_letters.read_all(client, keys)}
    assert letters == {(keys.episode(eid), entry) for eid, entry in bad.items()}
    assert trainer.counts["episodes_failed"] == 3 and trainer.counts["groups_dropped"] == 1
    # u3 gave its gate slot back
    assert int(client.get(keys.gate_started) or 0) == -1


# --- the step: micro-batches, minibatches, direction


def _episodes(client, keys, groups: list[str]) -> list[list]:
    log = EpisodeLog(client, keys, "r")
    return [[log.replay(f"{g}-{i}") for i in range(2)] for g in groups]


def _model_and_opt(model_dir, lr=1e-3, sgd=False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if sgd:
        return model, torch.optim.SGD(model.parameters(), lr=lr)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)


def test_micro_batches_train_exactly_as_one_big_batch(client, keys, tiny_model_dir):
    from services.trainer.step import StepConfig, train_on_batch

    for i, g in enumerate(("m1", "m2", "m3")):
        # rows of different lengths: padding differs per micro
        _write_group(client, keys, g, length=4 + 5 * i)
    batch = build_batch(_episodes(client, keys, ["m1", "m2", "m3"]), pad_id=0)
    results = []
    # no limit; about one row per micro-batch
    for budget in (0, 30):
        # SGD: the update is the accumulated gradient itself (Adam's first step, g/|g|, would amplify float
        # noise on parameters whose gradient is about 0 into a sign)
        model, opt = _model_and_opt(tiny_model_dir, lr=0.1, sgd=True)
        stats = train_on_batch(model, opt, batch, StepConfig(ppo_minibatches=2, micro_batch_tokens=budget))
        results.append((model.state_dict(), stats))
    (big, big_stats), (small, small_stats) = results
    assert big_stats["micro_batches"] == 2 and small_stats["micro_batches"] >= 4
    for k in big:
        torch.testing.assert_close(small[k], big[k], rtol=1e-5, atol=1e-6)
    assert small_stats["loss"] == pytest.approx(big_stats["loss"], rel=1e-5, abs=1e-7)
    assert small_stats["clip_fraction"] == pytest.approx(big_stats["clip_fraction"], abs=1e-6)


def test_the_second_minibatch_is_clipped_against_the_proximal_policy(client, keys, tiny_model_dir):
    from services.trainer.step import StepConfig, train_on_batch

    for g in ("c1", "c2", "c3", "c4"):
        _write_group(client, keys, g, length=12)
    batch = build_batch(_episodes(client, keys, ["c1", "c2", "c3", "c4"]), pad_id=0)
    model, opt = _model_and_opt(tiny_model_dir, lr=3e-2)
    one = train_on_batch(model, opt, batch, StepConfig(ppo_minibatches=1))
    # one step: the ratio to the proximal policy is 1
    assert one["clip_fraction"] == 0.0 and one["ppo_steps"] == 1
    model, opt = _model_and_opt(tiny_model_dir, lr=3e-2)
    two = train_on_batch(model, opt, batch, StepConfig(ppo_minibatches=2))
    # after the first step the clip binds
    assert two["ppo_steps"] == 2 and two["clip_fraction"] > 0.0


def test_one_step_raises_the_rewarded_episode_and_lowers_the_other(client, keys, tiny_model_dir):
    from services.trainer.step import StepConfig, policy_logprobs, train_on_batch

    _write_group(client, keys, "dir", rewards=[1.0, 0.0], length=8)
    batch = build_batch(_episodes(client, keys, ["dir"]), pad_id=0)
    model, opt = _model_and_opt(tiny_model_dir, lr=1e-2)

    def seq_logp():
        with torch.no_grad():
            return (policy_logprobs(model, batch, "cpu")[0] * batch.loss_mask).sum(dim=1)

    before = seq_logp()
    train_on_batch(model, opt, batch, StepConfig(ppo_minibatches=1))
    after = seq_logp()
    assert after[0] > before[0] and after[1] < before[1], (before, after)


def test_policy_failures_train_with_reward_zero_and_greedy_episodes_are_not_trained():
    evs = [started(prompt=(5, 6)), tokens(1, [10, 11]), finished(2, reward=1.0)]
    good = fold(raw(evs))
    cut = fold(raw(evs))
    # the budget ran out: the policy's doing
    cut.finish_reason = "length"
    greedy = fold(raw(evs))
    greedy.sampling = {"temperature": 0.0}
    b = build_batch([[good, cut], [greedy, good]], pad_id=0)
    assert b.rewards.tolist() == [1.0, 0.0, 1.0, 1.0] and b.policy_failures == 1
    assert b.advantages[0] > 0 > b.advantages[1]
    assert b.loss_mask[2].sum() == 0 and b.greedy_tokens == 2 and b.num_tokens == 6


def test_a_torn_last_ledger_line_is_ignored_and_repaired(tmp_path):
    from shared.protocol.archive.ledger import append_ledger, repair_ledger

    append_ledger(tmp_path, {"commit": 1, "groups": ["a"], "skipped": []})
    with open(tmp_path / "trained.jsonl", "a") as fh:
        # killed mid-append
        fh.write('{"commit": 2, "groups": ["b"')
    assert [r["groups"] for r in read_ledger(tmp_path)] == [["a"]]
    assert repair_ledger(tmp_path) > 0 and repair_ledger(tmp_path) == 0
    append_ledger(tmp_path, {"commit": 2, "groups": ["b"], "skipped": []})
    assert [r["groups"] for r in read_ledger(tmp_path)] == [["a"], ["b"]]


@pytest.mark.slow
def test_a_crash_at_each_point_of_the_commit_path_loses_nothing_and_trains_nothing_twice(
    client, keys, redis_url, tiny_model_dir, tmp_path
):
    """One trainer after another on the same run (a snapshot every 2 versions), each killed (SIGKILL, by the
    test-only hook) at the next point of its commit path, the publisher's thread or the snapshot's; each restart
    re-trains the commits after the newest snapshot. After each kill the ledger has no group twice; a last trainer
    finishes the run, then every version is published once, every re-derived version hashed as published, and the
    checker counts every group trained exactly once."""
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    ledger_dir = cfg.run_path / "trainer"
    groups = []
    # the commit path's points (the first, stepped, is mid-step: the kill -9 test's)
    for n, point in enumerate(faults.POINTS["trainer"][1:]):
        # one commit: 2 steps x 2 groups
        new = [f"g{n}{i}" for i in range(4)]
        for g in new:
            _write_group(client, keys, g)
        groups += new
        proc = _trainer_proc(redis_url, cfg, crash_at=point)
        try:
            # killed itself at this point
            assert proc.wait(180) == -signal.SIGKILL, point
        finally:
            if proc.poll() is None:
                kill9(proc)
        trained = [g for rec in read_ledger(ledger_dir) for g in rec["groups"]]
        assert len(trained) == len(set(trained)), point
    last = _finish(client, keys, ledger_dir, groups, _trainer_proc(redis_url, cfg), 180)
    records = read_ledger(ledger_dir)
    # every group trained, none twice
    assert sorted(g for rec in records for g in rec["groups"]) == sorted(groups)
    commits = [rec["commit"] for rec in records if "commit" in rec]
    assert commits == list(range(1, last + 1))
    # restores re-trained versions, and each one hashed as it was published
    replays = [json.loads(x) for x in (ledger_dir / "replays.jsonl").read_text().splitlines()]
    assert sum(len(r["replayed"]) for r in replays) > 0 and all(r["differing"] == [] for r in replays)
    again = Trainer(cfg, client, logs.get("trainer-test"))
    # the set of consumed groups a restart rebuilds (from the ledger) is every group, once
    again.restore()
    assert sorted(again.intake.consumed) == sorted(groups) and not again.intake.buffer
    assert again.version == last
    published = [v.version for v in pversions.read_all(client, keys)]
    # every version published, once
    assert published == list(range(1, last + 1))
    report = check(read_run(client, keys, cfg.run_path))
    assert report.groups_lost == 0 and report.samples_trained_twice == 0 and report.groups_trained == len(groups)
    assert report.versions_rederived_differently == 0 and report.versions_replayed > 0


def test_a_restore_re_trains_the_versions_after_the_snapshot_to_the_published_bytes(
    client, keys, tiny_model_dir, tmp_path
):
    """In one process: a trainer commits 6 versions (snapshots at 0 and 4); the archiver moves the episodes of
    versions up to 5 out of Redis into segments; a second trainer on the same run loads snapshot 4, re-trains versions
    5 (from the segments) and 6 (from Redis) and ends with the first one's weights and optimizer, bit for bit; a
    version whose published sha256 differs is reported, recorded, and training goes on from the re-derived one."""
    from services.archiver.mover import Mover

    cfg = _cfg(keys, tiny_model_dir, tmp_path, snapshot_every_versions=4)
    for i in range(12):
        _write_group(client, keys, f"r{i}")
    first = Trainer(cfg, client, logs.get("trainer-test"))
    first.run(should_stop=lambda: first.version >= 6)
    assert sorted(p.name for p in (cfg.run_path / "trainer" / "snapshots").iterdir()) == ["v000004.pt"]
    Mover(client, keys, cfg.run_path, retention=1).step()
    (line5,) = [r for r in read_ledger(cfg.run_path / "trainer") if r.get("commit") == 5]
    assert not any(client.exists(keys.episode(f"{g}-0")) for g in line5["groups"])
    second = Trainer(cfg, client, logs.get("trainer-test"))
    second.restore()
    second.publisher.close()
    assert (second.version, second.step) == (6, 6)
    for (k, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), k
    moments = lambda t: [s["exp_avg"] for s in t.opt.state_dict()["state"].values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(moments(first), moments(second)))
    assert second.counts == first.counts
    (rec,) = read_replays(cfg.run_path / "trainer")
    assert (rec["snapshot"], rec["replayed"], rec["differing"], rec["published"]) == (4, [5, 6], [], [])
    assert rec["missing_episodes"] == 0
    # version 6's event says another sha256 (as a non-deterministic kernel would leave it)
    newest = pversions.latest(client, keys)
    client.xdel(keys.versions, newest.entry_id)
    pversions.publish(client, keys, pversions.Version(6, newest.path, "0" * 64, newest.step, newest.time))
    third = Trainer(cfg, client, logs.get("trainer-test"))
    third.restore()
    third.publisher.close()
    assert read_replays(cfg.run_path / "trainer")[-1]["differing"] == [6] and third.version == 6
    report = check(read_run(client, keys, cfg.run_path))
    assert report.versions_rederived_differently == 1 and report.versions_replayed == 4


def test_the_trainer_snapshots_once_its_training_since_the_last_one_took_snapshot_replay_s(
    client, keys, tiny_model_dir, tmp_path, monkeypatch
):
    """By versions never (every 1,000), by the replay rule at every version: each train step counts, each commit
    checks, and the newest snapshot is the last version (a restart would re-train nothing)."""
    from services.trainer.state import snapshot

    # the rule's floor (20x the last snapshot's own cost) off, so that any train step is enough
    monkeypatch.setattr(snapshot, "COST_RATIO", 0)
    cfg = _cfg(keys, tiny_model_dir, tmp_path, snapshot_every_versions=1000, snapshot_replay_s=1e-9)
    for i in range(6):
        _write_group(client, keys, f"s{i}")
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    trainer.run(should_stop=lambda: trainer.version >= 3)
    assert [p.name for p in (cfg.run_path / "trainer" / "snapshots").iterdir()] == ["v000003.pt"]
    again = Trainer(cfg, client, logs.get("trainer-test"))
    again.restore()
    again.publisher.close()
    assert again.version == 3 and read_replays(cfg.run_path / "trainer") == []
