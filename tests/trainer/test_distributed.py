"""The trainer under torchrun (services/trainer/distributed.py): the command channel, the per-rank plan, one step
on 1 and on 2 ranks giving the same weights, and a rank killed -9 taking the job down with nothing trained twice."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from services.ops.check.checker import check, read_run
from services.trainer import distributed
from services.trainer.batch import build_batch
from services.trainer.state import sharded
from services.trainer.step import StepConfig, plan
from shared.protocol.archive.ledger import read_ledger
from shared.protocol.keys import TRAINER_GROUP
from shared.protocol.streams import versions as pversions
from shared.runtime import faults
from tests.support import dist_step
from tests.support.dist_step import RUNS, make_groups
from tests.support.procs import spawn, stop, wait_until
from tests.trainer.test_trainer import _cfg, _committed, _write_group


def test_a_step_command_and_its_batch_round_trip_through_a_real_process_group(tmp_path):
    """JSON bytes in a uint8 tensor (no pickle) and the batch's tensors, through gloo broadcasts (one rank)."""
    batch = build_batch(make_groups(), pad_id=0)
    ids = [("1-0", "g0", ["g0-0", "g0-1"]), ("2-0", "g1", ["g1-0", "g1-1", "g1-2"]), ("3-0", "gé", ["gé-0"])]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard = distributed.Shard(0, 1)
        message = distributed.broadcast(shard, distributed.step_message(ids, batch))
        got = distributed.broadcast_batch(shard, message, batch)
    finally:
        dist.destroy_process_group()
    assert [tuple(g) for g in message["groups"]] == [(e, g, eids) for e, g, eids in ids]
    for name, _, _ in distributed._FIELDS:
        value = getattr(got, name)
        assert value.dtype == getattr(batch, name).dtype and torch.equal(value, getattr(batch, name)), name
    assert got.episode_ids == batch.episode_ids and got.num_tokens == batch.num_tokens
    assert (got.policy_failures, got.greedy_tokens) == (batch.policy_failures, batch.greedy_tokens)


def test_a_malformed_command_is_refused_with_one_line():
    with pytest.raises(RuntimeError, match="not JSON"):
        distributed.decode(torch.tensor(list(b"\x80\x04pickle"), dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="expected an object with 'op'"):
        distributed.decode(distributed.encode({"groups": []}))


def test_every_rank_trains_a_share_of_each_minibatch_with_as_many_forwards():
    batch = build_batch(make_groups(), pad_id=0)
    sc = StepConfig(ppo_minibatches=2, micro_batch_tokens=20)
    one = plan(batch, sc)
    two = [plan(batch, sc, distributed.Shard(r, 2)) for r in (0, 1)]
    for k, (rows, micros) in enumerate(one):
        assert sorted(i for m in micros for i in m) == rows
        shares = [sorted(i for m in p[k][1] for i in m) for p in two]
        # a partition of the minibatch
        assert shares[0] and shares[1] and sorted(shares[0] + shares[1]) == rows
        # FSDP2 gathers weights in each forward: counts must match
        assert len(two[0][k][1]) == len(two[1][k][1])
        # the same minibatch (and denominator) on every rank
        assert two[0][k][0] == two[1][k][0] == rows


def _torchrun(module_args: list[str], out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = spawn("torch.distributed.run", "--nproc-per-node", "2", "-m", *module_args, env=env, log=out / "log.txt")
    assert proc.wait(240) == 0, (out / "log.txt").read_text()[-3000:]


@pytest.mark.slow
def test_the_same_batch_gives_the_same_weights_on_one_rank_and_on_two(tiny_model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    # one process: this one
    dist_step.main(tiny_model_dir, str(one))
    _torchrun(["tests.support.dist_step", tiny_model_dir, str(two)], two)
    initial = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    # measured on a 2-core CPU box: SGD max |difference| 4e-9, AdamW 2e-6 (its first step, g/|g|, amplifies
    # float noise where a gradient is about 0); the step moves weights by about 2e-3
    for name, atol in (("sgd", 1e-7), ("adamw", 2e-5)):
        a, b = load_file(str(one / f"{name}.safetensors")), load_file(str(two / f"{name}.safetensors"))
        assert a.keys() == b.keys()
        # the step did move them
        assert max(float((a[k] - initial[k]).abs().max()) for k in a) > 100 * atol
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=atol, msg=f"{name}: {k}")
        sa, sb = (json.loads((d / f"{name}.json").read_text()) for d in (one, two))
        assert sb["micro_batches"] >= sa["micro_batches"] and sa["ppo_steps"] == sb["ppo_steps"] == 2
        assert sb["loss"] == pytest.approx(sa["loss"], rel=1e-4) and sb["entropy"] == pytest.approx(sa["entropy"])
    # one of the two runs splits micro-batches
    assert RUNS["adamw"]["micro_batch_tokens"] > 0


def _torchrun_trainer(redis_url, cfg, log: Path, crash: dict | None = None):
    """The trainer as docs/training.md runs it; ``--`` ends torchrun's options (it reads ``--run`` as its own
    ``--run-path``). ``crash``: a crash point every rank gets (shared/runtime/faults.py)."""
    env = {**{k: v for k, v in os.environ.items() if k != faults.ENV}, "OMP_NUM_THREADS": "1", **(crash or {})}
    return spawn(
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "-m",
        "services.trainer",
        "--",
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
        "2",
        "--steps-per-version",
        "2",
        "--snapshot-every-versions",
        "2",
        # snapshots by versions only: the test names the versions a restore re-trains
        "--snapshot-replay-s",
        "0",
        "--max-staleness",
        "100",
        "--log-level",
        "info",
        env=env,
        log=log,
    )


def _ranks(agent_pid: int) -> dict[int, int]:
    """RANK -> pid of the agent's worker processes (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != agent_pid:
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(entry.name)
    return out


def _stop(job, ranks: dict[int, int]) -> list[int]:
    """Warm stop of the job (SIGTERM to torchrun, which passes it on); kill -9 of any rank left (torchrun starts
    each rank in a session of its own: killing the agent's group alone would leave them running). The ranks
    that were left."""
    stop(job, timeout=60)
    left = [pid for pid in ranks.values() if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow(seconds=60)
def test_a_rank_killed_9_takes_the_job_down_and_the_restart_trains_nothing_twice(
    client, keys, redis_url, tiny_model_dir, tmp_path
):
    """Three jobs of 2 ranks on one run (a sharded snapshot every 2 versions): the first dies at a crash point (rank 0
    kills itself after its first ledger line, before anything is published), the second re-trains that version from
    the log on both ranks and publishes it, then rank 1 is killed -9 after a commit while rank 0 holds delivered groups
    it has not committed; the third finishes. Every group is trained exactly once, every re-trained version hashes as
    published."""
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    ledger_dir, logs = cfg.run_path / "trainer", tmp_path / "logs"
    logs.mkdir()
    # 4 groups a commit (2 steps x 2 groups)
    groups = [f"g{i:02d}" for i in range(16)]
    for g in groups[:8]:
        _write_group(client, keys, g, length=16)
    job = _torchrun_trainer(redis_url, cfg, logs / "first.log", faults.spec("trainer", "after_ledger"))
    ranks = {}
    try:
        ranks.update(wait_until(lambda: len(r := _ranks(job.pid)) == 2 and r, "two ranks started", 60, [job]))
        assert job.wait(180) != 0
    finally:
        _stop(job, ranks)
    meta = json.loads((sharded.latest(ledger_dir) / "meta.json").read_text())
    # the snapshot a run starts with, sharded; version 1 is its ledger line only
    assert [r["commit"] for r in read_ledger(ledger_dir)] == [1] and meta["version"] == 0 and meta["world_size"] == 2
    assert not (ledger_dir / "snapshots").exists() and pversions.latest_number(client, keys) == 0
    for g in groups[8:12]:
        _write_group(client, keys, g, length=16)
    job = _torchrun_trainer(redis_url, cfg, logs / "second.log")
    ranks = {}
    try:
        ranks.update(wait_until(lambda: len(r := _ranks(job.pid)) == 2 and r, "two ranks started", 60, [job]))
        wait_until(
            lambda: len(read_ledger(ledger_dir)) >= 2 and client.xpending(keys.samples, TRAINER_GROUP)["pending"] > 0,
            "a commit and groups delivered but uncommitted",
            180,
            [job],
        )
        os.kill(ranks[1], signal.SIGKILL)
        # torchrun's agent stops the job (--max-restarts 0) and fails
        assert job.wait(120) != 0
        # rank 0 went down with it
        assert not _alive(ranks[0])
    finally:
        _stop(job, ranks)
    second = read_ledger(ledger_dir)
    assert 4 < len(_committed(ledger_dir)) < 12
    # the restart re-trained version 1 on both ranks and published it
    assert 1 in [v.version for v in pversions.read_all(client, keys)]
    trained = [g for rec in second for g in rec["groups"]]
    assert len(trained) == len(set(trained))
    for g in groups[12:]:
        _write_group(client, keys, g, length=16)
    job = _torchrun_trainer(redis_url, cfg, logs / "third.log")
    ranks = {}
    try:
        ranks.update(wait_until(lambda: len(r := _ranks(job.pid)) == 2 and r, "two ranks started", 60, [job]))
        wait_until(
            lambda: (
                _committed(ledger_dir) == set(groups) and client.xpending(keys.samples, TRAINER_GROUP)["pending"] == 0
            ),
            "every group committed",
            240,
            [job],
        )
    finally:
        left = _stop(job, ranks)
    log = (logs / "third.log").read_text()
    # a warm stop (SIGTERM to torchrun, passed on to the ranks): rank 0 told rank 1 to stop, neither was left running
    assert not left and "this rank stops with it" in log and "services/trainer" not in log, log[-3000:]
    records = read_ledger(ledger_dir)
    # every group trained, none twice
    assert sorted(g for rec in records for g in rec["groups"]) == groups
    commits = [rec["commit"] for rec in records]
    # each restart went on from the last commit
    assert commits == list(range(1, len(commits) + 1))
    published = [v.version for v in pversions.read_all(client, keys)]
    assert published == sorted(set(published)) and published[-1] == len(groups) // 4
    # the sharded snapshots written in the background landed: the newest is a later one, a warm stop waited for it
    newest = json.loads((sharded.latest(ledger_dir) / "meta.json").read_text())
    assert newest["version"] >= 2 and newest["world_size"] == 2 and not list(sharded.folder(ledger_dir).glob("*.tmp"))
    report = check(read_run(client, keys, cfg.run_path))
    assert report.groups_lost == 0 and report.samples_trained_twice == 0 and report.groups_trained == len(groups)
    # every restart re-trained the versions after its snapshot, each hashed as published
    assert report.versions_replayed >= 1 and report.versions_rederived_differently == 0
