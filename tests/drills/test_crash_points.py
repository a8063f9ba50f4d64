"""Deterministic crashes: a rollout worker or the syncer kills itself (SIGKILL) at one named point of its
work (shared/runtime/faults.py), then the service's next process repairs what it left. The trainer's
commit points are tests/trainer/test_trainer.py's."""

from __future__ import annotations

import signal

import pytest

from services.ops.check.checker import check, read_run
from services.syncer.syncer import Syncer
from services.trainer.publish import publish
from shared.protocol import gate
from shared.protocol.episode.fold import fold
from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime import faults, logs
from shared.runtime.config.keys import Config
from tests.support.gateway_stack import env_for
from tests.support.models import nudged_weights
from tests.support.procs import kill9, spawn, wait_until
from tests.support.rollout_harness import episodes, make_worker, samples, snapshot, tick_until, worker_info

pytestmark = pytest.mark.slow

GROUPS = [(f"g{i}", 2) for i in range(3)]
WORKER = dict(
    tools="", max_tokens=24, flush_tokens=4, flush_ms=20, heartbeat_ttl=1.0, max_groups_in_flight=3, step_delay_ms=5
)


def _env(redis_url, keys, model_dir, crash: dict | None = None) -> dict:
    env = {k: v for k, v in env_for(redis_url, keys, model_dir, **WORKER).items() if k != faults.ENV}
    return {**env, **(crash or {})}


@pytest.mark.parametrize("point,nth", [("opened", 1), ("flushed", 4), ("finished", 1)])
def test_a_rollout_worker_killed_at_each_point_loses_nothing_and_publishes_each_group_once(
    client, keys, redis_url, tiny_model_dir, point, nth
):
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in GROUPS])
    a = spawn(
        "services.rollout",
        "--worker-id",
        "A",
        env=_env(redis_url, keys, tiny_model_dir, faults.spec("rollout", point, nth)),
    )
    try:
        # it killed itself at the point
        assert a.wait(120) == -signal.SIGKILL
    finally:
        kill9(a)
    before = snapshot(client, keys, GROUPS)
    # every episode of one group ended in its stream, the group unpublished
    if point == "finished":
        assert samples(client, keys) == [] and any(ep.done for ep in before.values())
    b = make_worker(Config(run=keys.run, model_dir=tiny_model_dir, **WORKER), client, "B")
    tick_until(b, lambda: len(samples(client, keys)) == len(GROUPS), timeout=90)
    # each once
    assert sorted(s["group_id"] for s in samples(client, keys)) == sorted(g for g, _ in GROUPS)
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    after = episodes(client, keys, GROUPS)
    for eid, ep in after.items():
        assert ep.done and sum(e.kind in ("finished", "failed") for e in ep.events) == 1, eid
        # what A wrote stays, unchanged
        if eid in before:
            assert ep.tokens[: len(before[eid].tokens)] == before[eid].tokens
    # killed right after a flush of everything: nothing generated twice
    if point in ("opened", "finished"):
        stored = sum(len(ep.tokens) for ep in before.values())
        assert b.stats["tokens"] == sum(len(ep.tokens) for ep in after.values()) - stored
    report = check(read_run(client, keys, Config(run=keys.run).run_path))
    assert report.groups_lost == 0 and report.episodes_finished_twice == 0


@pytest.mark.parametrize("point", faults.POINTS["syncer"])
def test_a_syncer_killed_after_each_command_is_repaired_by_the_next_one(
    client, keys, redis_url, tiny_model_dir, tmp_path, point
):
    """Killed right after sending fetch, pause, load or resume: the worker may be left paused, loaded or not; the
    next syncer finds it behind or paused at start, syncs the newest version again, and the worker ends
    resumed at that version, generating with it."""
    enqueue(client, keys, [PromptGroup(f"s{i}", 2, prompt=f"{i}*5=") for i in range(6)])
    env = _env(redis_url, keys, tiny_model_dir)
    worker = spawn("services.rollout", "--worker-id", "A", "--max-tokens", "400", env=env)
    try:
        wait_until(lambda: worker_info(client, keys, "A").get("episodes", "0") != "0", "A generating", 90, [worker])
        first = spawn("services.syncer", env={**env, **faults.spec("syncer", point)})
        try:
            wait_until(lambda: client.exists(keys.gate), "the first syncer ready", 60, [worker])
            publish(client, keys, 1, *nudged_weights(tiny_model_dir, tmp_path, 1), step=1)
            # it killed itself right after sending `point`
            assert first.wait(60) == -signal.SIGKILL
        finally:
            kill9(first)
        if point == "pause":
            wait_until(lambda: worker_info(client, keys, "A").get("paused") == "1", "A paused", 30, [worker])
        cfg = Config(run=keys.run, model_dir=tiny_model_dir, heartbeat_ttl=WORKER["heartbeat_ttl"], sync_timeout=20)
        second = Syncer(cfg, client, logs.get("syncer-test"))
        # a restarted syncer: finds the worker behind (or paused) and syncs again
        second.start()
        wait_until(
            lambda: (
                worker_info(client, keys, "A").get("version") == "1"
                and worker_info(client, keys, "A").get("paused") == "0"
            ),
            "A resumed at version 1",
            30,
            [worker],
        )
        assert gate.opened_version(client, keys) == 1 and second.version == 1

        def tokens_of_v1():
            return any(1 in fold(client.xrange(k)).versions for k in client.scan_iter(match=keys.episode("*")))

        wait_until(tokens_of_v1, "tokens generated with version 1", 30, [worker])
    finally:
        kill9(worker)
