"""The rollout worker's step writer (services/rollout/episodes/step_writer.py): an engine step's writes travel on a
thread while the next step runs, and their results are applied one step later. What must still hold: a fence reported
late drops the whole group before anything of it is published; a group is published only after every episode's end is
in its stream (killed in between, nothing is lost or trained twice); a pause or a shutdown with a batch in flight
loses no token."""

from __future__ import annotations

import signal

import pytest
import structlog

from services.ops.check.checker import check, read_run
from shared.protocol.episode.events import decode
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime import faults
from shared.runtime.config.keys import Config
from tests.support.gateway_stack import env_for
from tests.support.procs import kill9, spawn
from tests.support.rollout_harness import episodes, make_worker, samples, send, snapshot, tick_until


def _groups(n: int, size: int = 2) -> list[tuple[str, int]]:
    return [(f"g{i}", size) for i in range(n)]


def _enqueue(client, keys, groups) -> None:
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in groups])


def _ends_in_redis(client, keys) -> None:
    """Every published group's episodes have their end in their streams (samples read first, streams after)."""
    log = EpisodeLog(client, keys, "reader")
    for sample in samples(client, keys):
        for episode_id in sample["episodes"].split(","):
            assert fold(log.read(episode_id)).done, f"{sample['group_id']} published before {episode_id} ended"


def test_a_fence_reported_a_step_later_drops_the_group_and_nothing_of_it_is_published(client, keys, tiny_model_dir):
    """Another writer appends to an episode in the very step that ends its group: the batch that carries the
    group's last events comes back fenced one step later, and the group leaves the worker unpublished."""
    groups = _groups(3)
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=24,
        tools="",
        flush_tokens=4,
        flush_ms=1e6,
        heartbeat_ttl=600.0,
        max_groups_in_flight=3,
    )
    _enqueue(client, keys, groups)
    a = make_worker(cfg, client, "A")
    intruder = EpisodeLog(client, keys, "X")
    fenced: dict[str, str] = {}
    send_step = a.episodes.writes.send_step

    def intrude_then_send(wake_read=None):
        # ended in this step: their last events leave with this step's batch
        ending = a.episodes.writes.ending
        for live in ending if not fenced else ():
            run = a.claims.get(live.group_id)
            if run is None or run.done | {e.episode_id for e in ending if e.group_id == run.group.group_id} != set(
                run.episodes
            ):
                # this step does not end the whole group
                continue
            ep = fold(intruder.read(live.episode_id))
            intruder.open(live.episode_id, ep.last_seq + 1)
            intruder.append(live.episode_id, "resumed", {"num_tokens": len(ep.tokens), "takeover_from": "A"}, 0)
            intruder.flush_or_raise()
            fenced.update(group=live.group_id, episode=live.episode_id)
            break
        send_step(wake_read)
        if fenced.get("episode") and "in_flight" not in fenced:
            fenced["in_flight"] = str(a.episodes.writes.writer.in_flight)

    a.episodes.writes.send_step = intrude_then_send
    with structlog.testing.capture_logs() as logs:
        tick_until(a, lambda: bool(fenced) and fenced["group"] not in a.groups)
        tick_until(a, lambda: len(samples(client, keys)) == len(groups) - 1 and not a.groups)
    # the fenced write went on the writer thread, its result came later
    assert fenced["in_flight"] == "True"
    warnings = [e for e in logs if e["event"].startswith("fenced")]
    assert [(e["group"], e["new_owner"]) for e in warnings] == [(fenced["group"], "X")]
    assert fenced["group"] not in {s["group_id"] for s in samples(client, keys)}
    assert not client.exists(keys.sampled(fenced["group"]))
    pending = client.xpending_range(keys.prompts, ROLLOUT_GROUP, "-", "+", 100)
    # the fenced group's prompt stays pending: its new owner publishes it
    assert len(pending) == 1
    # nothing of A's after the intruder's entry
    assert decode(*intruder.read(fenced["episode"])[-1]).worker == "X"
    assert not [live for live in a.live.values() if live.group_id == fenced["group"]]


def test_no_group_is_published_before_its_episodes_ends_are_in_redis(client, keys, tiny_model_dir):
    groups = _groups(8)
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=16,
        tools="",
        flush_tokens=16,
        flush_ms=1e6,
        max_groups_in_flight=4,
    )
    _enqueue(client, keys, groups)
    a = make_worker(cfg, client, "A")
    tick_until(a, lambda: len(samples(client, keys)) == len(groups), on_tick=lambda _: _ends_in_redis(client, keys))
    assert sorted(s["group_id"] for s in samples(client, keys)) == sorted(g for g, _ in groups)
    report = check(read_run(client, keys, Config(run=keys.run).run_path))
    assert report.groups_lost == 0 and report.episodes_finished_twice == 0


@pytest.mark.slow
@pytest.mark.parametrize("point,nth", [("finished", 2), ("flushed", 9)])
def test_a_worker_killed_between_a_groups_last_events_and_its_publish_loses_nothing(
    client, keys, redis_url, tiny_model_dir, point, nth
):
    """SIGKILL at ``finished`` (a group's ends are in Redis, its publish queued for the next step's pipeline) or
    ``flushed`` (a batch settled, the next one maybe in flight): whatever A published had every end in Redis,
    and B finishes the rest: every group once, no episode ended twice."""
    groups = _groups(4)
    settings = dict(
        tools="", max_tokens=24, flush_tokens=4, flush_ms=20, heartbeat_ttl=1.0, max_groups_in_flight=2, step_delay_ms=5
    )
    _enqueue(client, keys, groups)
    env = {k: v for k, v in env_for(redis_url, keys, tiny_model_dir, **settings).items() if k != faults.ENV}
    a = spawn("services.rollout", "--worker-id", "A", env={**env, **faults.spec("rollout", point, nth)})
    try:
        # it killed itself at the point
        assert a.wait(120) == -signal.SIGKILL
    finally:
        kill9(a)
    _ends_in_redis(client, keys)
    # the group whose publish was queued: every episode ended, not published
    if point == "finished":
        published = {s["group_id"] for s in samples(client, keys)}
        before = snapshot(client, keys, groups)
        assert any(
            g not in published and all(before.get(f"{g}-{i}") and before[f"{g}-{i}"].done for i in range(n))
            for g, n in groups
        )
    b = make_worker(Config(run=keys.run, model_dir=tiny_model_dir, **settings), client, "B")
    tick_until(
        b, lambda: len(samples(client, keys)) == len(groups), timeout=90, on_tick=lambda _: _ends_in_redis(client, keys)
    )
    # each once
    assert sorted(s["group_id"] for s in samples(client, keys)) == sorted(g for g, _ in groups)
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    for eid, ep in episodes(client, keys, groups).items():
        assert ep.done and sum(e.kind in ("finished", "failed") for e in ep.events) == 1, eid
    report = check(read_run(client, keys, Config(run=keys.run).run_path))
    assert report.groups_lost == 0 and report.episodes_finished_twice == 0


def test_a_pause_and_a_shutdown_with_a_batch_in_flight_lose_no_token(client, keys, tiny_model_dir):
    """Every token the engine produced (the worker's count) is in the streams after a pause that arrived while a
    batch was in flight, and again after a shutdown with one in flight."""
    groups = _groups(6)
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=48,
        tools="",
        flush_tokens=2,
        flush_ms=1e6,
        max_groups_in_flight=6,
    )
    _enqueue(client, keys, groups)
    a = make_worker(cfg, client, "A")

    def in_streams() -> int:
        return sum(len(ep.tokens) for ep in snapshot(client, keys, groups).values())

    tick_until(a, lambda: a.episodes.writes.writer.in_flight and a.stats["tokens"] >= 40)
    # read with the step's writes, obeyed one step later
    send(client, keys, "pause")
    tick_until(a, lambda: a.paused)
    assert not a.episodes.writes.writer.in_flight
    assert in_streams() == a.stats["tokens"]
    stored = snapshot(client, keys, groups)
    for episode_id, live in a.live.items():
        assert stored[episode_id].tokens == live.tokens, episode_id
    produced = a.stats["tokens"]
    send(client, keys, "resume", sync="s2")
    tick_until(a, lambda: a.episodes.writes.writer.in_flight and a.stats["tokens"] >= produced + 20 and a.live)
    a.shutdown()
    assert not a.episodes.writes.writer.in_flight
    assert in_streams() == a.stats["tokens"]
    stored = snapshot(client, keys, groups)
    for episode_id, live in a.live.items():
        assert stored[episode_id].tokens == live.tokens, episode_id
