"""mode = "sync": the synchronous baseline. Rollout waits for the trainer (a group starts only under the
version the gate opened for it), the trainer waits for a full batch, so every trained token was generated
by the trainer's own version: staleness 0, exactly batch_groups groups per version, nothing wasted."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from services.syncer.syncer import Syncer
from services.trainer.trainer import Trainer
from shared.protocol.archive.ledger import read_ledger
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime import logs
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.config.sources import load
from shared.runtime.connection import connect
from tests.support.procs import wait_until
from tests.support.rollout_harness import make_worker, tick_until


def _cfg(keys, model_dir, tmp_path, **kw) -> Config:
    base = dict(
        run=keys.run,
        model_dir=model_dir,
        run_dir=str(tmp_path / "runs"),
        weights_dir=str(tmp_path / "w"),
        mode="sync",
        max_staleness=0,
        batch_groups=2,
        group_size=2,
        max_tokens=6,
        tools="",
        max_groups_in_flight=8,
        flush_tokens=2,
        flush_ms=5.0,
        heartbeat_ttl=3.0,
    )
    return Config(**{**base, **kw})


def _enqueue(client, keys, n: int, group_size: int = 2) -> None:
    enqueue(
        client,
        keys,
        [
            PromptGroup(f"s{i:03d}", group_size, prompt=f"{i % 10}+{i % 7}=", task={"answer": str(i % 10 + i % 7)})
            for i in range(n)
        ],
    )


def test_sync_mode_needs_max_staleness_zero():
    with pytest.raises(ConfigError, match="mode 'sync' .* needs max_staleness = 0, got 1"):
        load(env={}, overrides={"mode": "sync"})
    assert load(env={}, overrides={"mode": "sync", "max_staleness": "0"}).mode == "sync"


def test_sync_worker_waits_for_the_gate_and_for_the_gates_version(client, keys, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    _enqueue(client, keys, 6)
    worker = make_worker(cfg, client)
    # no gate yet: in async mode this would start every group; in sync mode none
    for _ in range(20):
        worker.tick(block_ms=1)
    assert worker.groups == {} and client.xlen(keys.samples) == 0
    client.hset(keys.gate, mapping={"version": 1, "limit": 4, "max_staleness": 0})
    # a gate for version 1 while the worker still runs version 0: still nothing
    for _ in range(20):
        worker.tick(block_ms=1)
    assert worker.groups == {} and client.xlen(keys.samples) == 0
    client.hset(keys.gate, mapping={"version": 0, "limit": 2})
    tick_until(worker, lambda: client.xlen(keys.samples) == 2, timeout=30)
    for _ in range(20):
        worker.tick(block_ms=1)
    # exactly the gate's limit, nothing more
    assert client.xlen(keys.samples) == 2


def test_sync_run_trains_every_token_under_the_version_that_generated_it(redis_url, keys, tiny_model_dir, tmp_path):
    """Trainer, syncer and a rollout worker as real loops (threads) on the real server."""
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    target = 4
    setup = connect(redis_url)
    _enqueue(setup, keys, 30)
    trainer = Trainer(cfg, connect(redis_url), logs.get("trainer-test"))
    syncer = Syncer(cfg, connect(redis_url), logs.get("syncer-test"))
    worker = make_worker(cfg, connect(redis_url))
    stop = threading.Event()
    # group id -> trainer version when it was trained
    trained_at: dict[str, int] = {}
    train_step = trainer.train_step

    def spy(groups):
        for _, group_id, _ in groups:
            trained_at[group_id] = trainer.version
        return train_step(groups)

    trainer.train_step = spy
    errors = []

    def loop(fn):
        try:
            fn(should_stop=stop.is_set)
        # surfaced below: a crashed loop fails the test
        except Exception as exc:
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=loop, args=(c.run,), daemon=True) for c in (syncer, worker)]
    threads.append(
        threading.Thread(
            target=loop,
            args=(lambda should_stop: trainer.run(should_stop=lambda: should_stop() or trainer.version >= target),),
            daemon=True,
        )
    )
    reader = EpisodeLog(setup, keys, "reader")

    # groups started per version (their first episode's 'started' event)
    def started_under() -> Counter:
        out = Counter()
        for key in setup.scan_iter(match=keys.episode("s*"), count=1000):
            ep = fold(reader.read(keys.episode_id(key)))
            if ep.index == 0:
                out[ep.events[0].policy] += 1
        return out

    for t in threads:
        t.start()
    wait_until(lambda: errors or trainer.version >= target, "the trainer reaching the target version", 120)
    # the worker starts the last version's groups under the gate
    wait_until(
        lambda: errors or started_under()[target] >= cfg.batch_groups, "groups started under the last version", 60
    )
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors

    ledger = read_ledger(cfg.run_path / "trainer")
    assert [rec["version"] for rec in ledger] == list(range(1, target + 1))
    assert all(rec["skipped"] == [] for rec in ledger) and trainer.counts["groups_dropped"] == 0
    for rec in ledger:
        assert len(rec["groups"]) == cfg.batch_groups
        for gid in rec["groups"]:
            for i in range(cfg.group_size):
                ep = fold(reader.read(f"{gid}-{i}"))
                generated = [v for v in ep.versions if v >= 0]
                assert generated and set(generated) == {trained_at[gid]} == {rec["version"] - 1}, (gid, ep.versions)
    # the gate opened exactly batch_groups starts per version, and the worker took no more
    starts = started_under()
    assert all(starts[v] == cfg.batch_groups for v in range(target + 1)), starts
    assert set(starts) <= set(range(target + 1))
