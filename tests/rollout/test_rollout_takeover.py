"""Crash takeover: a rollout worker dies; another finishes its episodes from the streams."""

from __future__ import annotations

import pytest

from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from tests.support.procs import gone_worker_id, kill9, stop, wait_until
from tests.support.rollout_harness import (
    episodes,
    make_worker,
    samples,
    snapshot,
    tick_until,
    wait_claimable,
    worker_proc,
)

GROUPS = [(f"g{i}", 2) for i in range(6)]


def _worker_proc(redis_url, keys, model_dir, worker_id, log=None):
    return worker_proc(redis_url, keys, model_dir, worker_id, log=log)


def _snapshot(client, keys):
    return snapshot(client, keys, GROUPS)


@pytest.mark.slow
def test_kill_9_mid_episodes_another_worker_finishes_all(client, keys, redis_url, tiny_model_dir):
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in GROUPS])
    a = _worker_proc(redis_url, keys, tiny_model_dir, "A")
    try:
        wait_until(
            lambda: sum(len(ep.tokens) >= 8 and not ep.done for ep in _snapshot(client, keys).values()) >= 6,
            "worker A generating 6 episodes",
            60,
            [a],
        )
    finally:
        kill9(a)
    before = _snapshot(client, keys)
    assert len(samples(client, keys)) < len(GROUPS)
    b = _worker_proc(redis_url, keys, tiny_model_dir, "B")
    try:
        wait_until(lambda: len(samples(client, keys)) == len(GROUPS), "B finishing every group", 90, [b])
    finally:
        stop(b)
    got = [s["group_id"] for s in samples(client, keys)]
    # every group exactly once: none lost, none twice
    assert sorted(got) == sorted(g for g, _ in GROUPS)
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    after = episodes(client, keys, GROUPS)
    taken_over = 0
    for eid, ep in after.items():
        assert ep.status == "finished"
        assert sum(e.kind == "finished" for e in ep.events) == 1
        # every token flushed before the kill is still there, unchanged
        if eid in before:
            old = before[eid]
            assert ep.tokens[: len(old.tokens)] == old.tokens
            assert ep.logprobs[: len(old.logprobs)] == old.logprobs
            if not old.done:
                assert ep.resumes and ep.resumes[0]["takeover_from"] == "A"
                assert ep.resumes[0]["num_tokens"] >= len(old.tokens)
                taken_over += 1
    assert taken_over >= 6


@pytest.mark.slow
def test_after_a_warm_sigterm_another_worker_resumes_each_episode_where_it_stopped_and_generates_nothing_again(
    client, keys, redis_url, tiny_model_dir, tmp_path
):
    """SIGTERM (honcho's stop): A exits 0 after recording, in each unfinished episode, an 'aborted' event at the
    exact number of tokens it had generated (everything flushed). B takes every group over; each of its
    resumes starts at that count, and B generates exactly the tokens that were still missing."""
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in GROUPS])
    a = _worker_proc(redis_url, keys, tiny_model_dir, "A", log=tmp_path / "A.log")
    try:
        wait_until(
            lambda: sum(len(ep.tokens) >= 8 and not ep.done for ep in _snapshot(client, keys).values()) >= 6,
            "worker A generating 6 episodes",
            60,
            [a],
        )
    finally:
        (code,) = stop(a)
    assert code == 0, (tmp_path / "A.log").read_text()
    before = _snapshot(client, keys)
    stopped = {eid: ep for eid, ep in before.items() if not ep.done}
    assert len(stopped) >= 6
    for ep in stopped.values():
        assert ep.status == "paused" and ep.aborts[-1]["reason"] == "shutdown"
        # nothing generated was left unflushed
        assert ep.aborts[-1]["num_tokens"] == len(ep.tokens)
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=48,
        tools="",
        flush_tokens=4,
        flush_ms=20,
        heartbeat_ttl=1.5,
        max_groups_in_flight=6,
    )
    b = make_worker(cfg, client, "B")
    tick_until(b, lambda: len(samples(client, keys)) == len(GROUPS), timeout=90)
    assert sorted(s["group_id"] for s in samples(client, keys)) == sorted(g for g, _ in GROUPS)
    after = episodes(client, keys, GROUPS)
    for eid, old in stopped.items():
        ep = after[eid]
        assert ep.status == "finished" and ep.tokens[: len(old.tokens)] == old.tokens
        assert ep.resumes[-1]["takeover_from"] == "A" and ep.resumes[-1]["num_tokens"] == len(old.tokens)
    stored_before = sum(len(ep.tokens) for ep in before.values())
    assert b.stats["tokens"] == sum(len(ep.tokens) for ep in after.values()) - stored_before


def test_only_unflushed_tokens_are_generated_again(client, keys, tiny_model_dir):
    """Crash in-process (the worker object is abandoned without a flush), so the
    number of lost tokens is known exactly and compared with what B regenerates."""
    cfg = Config(
        run=keys.run, model_dir=tiny_model_dir, max_tokens=48, tools="", flush_tokens=8, flush_ms=1e6, heartbeat_ttl=0.5
    )
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in GROUPS])
    a = make_worker(cfg, client, "A")
    tick_until(a, lambda: a.stats["tokens"] >= 150)
    # the step's batch on the writer thread lands (the crash comes after it)
    if a.episodes.writes.writer.in_flight:
        a.episodes.writes.writer.wait()
    in_flight = len(a.live)
    stored = sum(len(ep.tokens) for ep in _snapshot(client, keys).values())
    unflushed = a.stats["tokens"] - stored
    # what the heartbeat TTL does after a kill -9
    client.delete(keys.alive("rollout", "A"))
    wait_claimable(client, keys, "A", cfg.heartbeat_ttl)
    b = make_worker(cfg, client, "B")
    tick_until(b, lambda: len(samples(client, keys)) == len(GROUPS))
    final = sum(len(ep.tokens) for ep in episodes(client, keys, GROUPS).values())
    regenerated = a.stats["tokens"] + b.stats["tokens"] - final
    print(f"in-flight episodes {in_flight}, unflushed at crash {unflushed}, regenerated {regenerated}")
    assert regenerated == unflushed
    assert unflushed <= (cfg.flush_tokens - 1) * in_flight


def test_fenced_worker_drops_whole_groups_and_gets_them_back_clean(client, keys, tiny_model_dir):
    """In-process: A stalls (stops ticking) past its heartbeat, B takes its groups over and writes;
    A wakes: every fenced group leaves A whole (no later write reaches a closed log), A logs it once per group
    with the new owner. Then B stalls, A takes the groups back and starts them clean; B wakes, fenced too."""
    import structlog

    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=48,
        tools="",
        flush_tokens=4,
        flush_ms=1e6,
        heartbeat_ttl=0.5,
        max_groups_in_flight=6,
    )
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in GROUPS])
    a = make_worker(cfg, client, "A")
    tick_until(a, lambda: sum(len(ep.tokens) >= 4 for ep in _snapshot(client, keys).values()) >= 6)
    held = set(a.groups)

    # what a SIGSTOP looks like from outside: the heartbeat lapses, nothing is written
    def stall(worker, name):
        client.delete(keys.alive("rollout", name))
        wait_claimable(client, keys, name, cfg.heartbeat_ttl)

    stall(a, "A")
    b = make_worker(cfg, client, "B")
    tick_until(b, lambda: b.stats["takeovers"] >= 1 and set(b.groups) >= held)
    # B wrote into A's episodes
    tick_until(b, lambda: not b.events.due() and b.stats["tokens"] > 0)
    with structlog.testing.capture_logs() as logs:
        # A wakes and writes (its next flush): fenced
        tick_until(a, lambda: not (held & set(a.groups)))
        fenced = [e for e in logs if e["event"].startswith("fenced")]
    assert fenced and all(e["log_level"] == "warning" and e["new_owner"] == "B" for e in fenced)
    # once per group
    assert len({e["group"] for e in fenced}) == len(fenced)
    lost = {e["group"] for e in fenced}
    assert not lost & set(a.groups) and not [eid for eid, live in a.live.items() if live.group_id in lost]
    stall(b, "B")
    tick_until(a, lambda: len(samples(client, keys)) == len(GROUPS) or set(a.groups) >= lost, timeout=60)
    # B wakes: fenced in turn, drops them
    tick_until(b, lambda: all(g not in b.groups for g in lost))
    for _ in range(2000):
        if len(samples(client, keys)) == len(GROUPS):
            break
        a.tick(block_ms=1)
        b.tick(block_ms=1)
    got = sorted(s["group_id"] for s in samples(client, keys))
    # every group exactly once
    assert got == sorted(g for g, _ in GROUPS)
    after = episodes(client, keys, GROUPS)
    assert all(ep.status == "finished" and sum(e.kind == "finished" for e in ep.events) == 1 for ep in after.values())


def test_a_heartbeat_miss_from_an_earlier_stall_does_not_make_a_live_worker_dead_at_once(client, keys, monkeypatch):
    """B saw X's heartbeat missing once (X stalled); X came back while it had no idle entries, so no
    look at its entries saw it alive; much later every heartbeat lapsed at once (a Redis restart). X counts as dead
    only a whole heartbeat_ttl after that lapse, never on the first look (its groups were taken over 0.4 s after
    Redis came back): every take-over pass forgets the records of owners alive again, whether B has room or not."""
    import types

    from services.rollout.groups import claims
    from shared.runtime import logs

    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(claims, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    groups = claims.Groups(
        Config(run=keys.run, heartbeat_ttl=2.0, max_groups_in_flight=0), client, keys, "B", logs.get("takeover-test")
    )
    groups.create_consumer_groups()
    idle = [{"consumer": b"X", "time_since_delivered": 60_000, "message_id": b"1-0"}]
    # X's heartbeat missing: first sighting
    assert groups._dead_owners(idle, 2000) == {}
    # X alive again, nothing of it idle
    client.hset(keys.alive("rollout", "X"), "version", 0)
    clock.now += 1.0
    # B's timer pass, with no room
    assert groups.take_over() == []
    # the mass lapse, long after
    client.delete(keys.alive("rollout", "X"))
    clock.now += 600.0
    # a first sighting again: not dead at once
    assert groups._dead_owners(idle, 2000) == {}
    clock.now += 1.0
    assert groups._dead_owners(idle, 2000) == {}
    clock.now += 1.0
    # missing for a whole heartbeat_ttl: dead
    assert groups._dead_owners(idle, 2000) == {"X": (2000, [b"1-0"])}


def test_gone_is_certain_only_for_a_reaped_process_of_this_host():
    import os
    import socket

    from shared.runtime import heartbeat

    assert heartbeat.gone(gone_worker_id())
    host = socket.gethostname()
    # alive; another host; another form of id: the heartbeat decides
    assert not heartbeat.gone(heartbeat.new_worker_id("rollout"))
    assert not heartbeat.gone(f"rollout-{host}-{os.getpid()}-abcd")
    assert not heartbeat.gone(f"rollout-not-{host}x-999999999-abcd")
    assert not heartbeat.gone("A") and not heartbeat.gone("rollout-replay")


def test_the_groups_of_a_gone_worker_of_this_host_are_taken_over_at_once_while_its_heartbeat_still_lives(client, keys):
    """X's process exited a moment ago and its heartbeat key has a minute left: B takes X's group over on its
    first pass, without waiting for the key to expire (heartbeat_ttl 60 s here). A live worker's group stays."""
    import os
    import socket
    import time

    from services.rollout.groups import claims
    from shared.runtime import logs

    groups = claims.Groups(
        Config(run=keys.run, heartbeat_ttl=60.0, max_groups_in_flight=8), client, keys, "B", logs.get("takeover-test")
    )
    groups.create_consumer_groups()
    enqueue(client, keys, [PromptGroup("gone", 2, prompt="1+1="), PromptGroup("live", 2, prompt="2+2=")])
    gone, live = gone_worker_id(), f"rollout-{socket.gethostname()}-{os.getpid()}-live"
    for owner in (gone, live):
        client.hset(keys.alive("rollout", owner), "version", 0)
        client.expire(keys.alive("rollout", owner), 60)
        client.xreadgroup(ROLLOUT_GROUP, owner, {keys.prompts: ">"}, count=1)
    # idle long enough that a claim of the same entry a moment before would have reset it
    time.sleep(claims.GONE_MIN_IDLE_MS / 1000 + 0.05)
    runs = groups.take_over()
    assert [(run.group.group_id, run.takeover_from) for run in runs] == [("gone", gone)]
    owners = {p["consumer"].decode() for p in client.xpending_range(keys.prompts, ROLLOUT_GROUP, "-", "+", 10)}
    assert owners == {"B", live}
