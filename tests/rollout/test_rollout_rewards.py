"""Rewards off the decode loop: reward functions (async too) run as rq jobs on the tools queue; a slow one
delays no other episode's tokens, a raising one fails its episode and the group is still published."""

from __future__ import annotations

import pytest

from services.rollout.jobs import rewards
from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from tests.support.rollout_harness import episodes, make_worker, samples, tick_until, tools_worker  # noqa: F401


def order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a sortable pair: (server ms, sequence)."""
    ms, n = entry_id.split("-")
    return int(ms), int(n)


def test_built_in_reward_is_inline_user_rewards_are_jobs():
    assert rewards.load("services.rollout.jobs.rewards:arithmetic").inline
    # async: never in the decode loop
    assert not rewards.load("tests.support.debug_tools:slow_reward").inline
    assert not rewards.load("tests.support.debug_tools:raising_reward").inline
    assert rewards.run_reward("tests.support.debug_tools:slow_reward", "1+1=", "2", {}) == [1.0, {"prompt": "1+1="}]
    with pytest.raises(ValueError, match="config key 'reward_fn': 'nope:f': cannot load"):
        rewards.load("nope:f")


def test_slow_reward_does_not_delay_other_episodes_tokens(client, keys, tiny_model_dir, tools_worker):
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=48,
        tools="",
        flush_tokens=4,
        flush_ms=20.0,
        step_delay_ms=40.0,
        reward_fn="tests.support.debug_tools:slow_reward",
        heartbeat_ttl=2.0,
    )
    tools_worker(cfg)
    enqueue(
        client,
        keys,
        [
            PromptGroup("slow", 1, prompt="5+5=", task={"sleep": 3}, sampling={"max_tokens": 2}),
            PromptGroup("busy", 3, prompt="7+1="),
        ],
    )
    worker = make_worker(cfg, client)
    tick_until(worker, lambda: len(samples(client, keys)) == 2, timeout=120)
    eps = episodes(client, keys, [("slow", 1), ("busy", 3)])
    slow = eps["slow-0"]
    assert slow.status == "finished" and slow.reward == 1.0 and slow.reward_details == {"prompt": "5+5="}
    # its last event before 'finished': generation was over here
    generated_until = slow.events[-2].entry_id
    scored_at = slow.events[-1].entry_id
    during = [
        ev
        for eid, ep in eps.items()
        if eid != "slow-0"
        for ev in ep.events
        if ev.kind == "tokens" and order(generated_until) < order(ev.entry_id) < order(scored_at)
    ]
    assert during, "no other episode wrote tokens while the slow reward ran"
    assert all(ep.status == "finished" for ep in eps.values())


def test_raising_reward_fails_the_episode_and_the_group_is_published(client, keys, tiny_model_dir, tools_worker):
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=8,
        tools="",
        reward_fn="tests.support.debug_tools:raising_reward",
    )
    tools_worker(cfg)
    enqueue(
        client,
        keys,
        [PromptGroup("bad", 2, prompt="1+1=", task={"raise": "boom"}), PromptGroup("good", 1, prompt="1+2=")],
    )
    worker = make_worker(cfg, client)
    tick_until(worker, lambda: len(samples(client, keys)) == 2, timeout=60)
    assert sorted(s["group_id"] for s in samples(client, keys)) == ["bad", "good"]
    eps = episodes(client, keys, [("bad", 2), ("good", 1)])
    for eid in ("bad-0", "bad-1"):
        ep = eps[eid]
        assert ep.status == "failed" and "RuntimeError: reward asked to fail: boom" in ep.error, ep.error
        assert ep.events[-1].data["where"] == "reward"
    assert eps["good-0"].status == "finished" and eps["good-0"].reward == 0.5
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0


def test_group_aware_reward_scores_once_the_whole_group_has_generated(client, keys, tiny_model_dir, tools_worker):
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=16,
        tools="",
        temperature=1.0,
        reward_fn="tests.support.debug_tools:longest_in_group",
    )
    tools_worker(cfg)
    assert rewards.load(cfg.reward_fn).group_aware and not rewards.load(cfg.reward_fn).inline
    enqueue(client, keys, [PromptGroup("g", 3, prompt="4+4=")])
    worker = make_worker(cfg, client)
    tick_until(worker, lambda: len(samples(client, keys)) == 1, timeout=60)
    eps = episodes(client, keys, [("g", 3)])
    texts = {eid: worker.episodes.tok.decode(ep.tokens, skip_special_tokens=True) for eid, ep in eps.items()}
    longest = max(len(t) for t in texts.values())
    last_token_event = max(order(ev.entry_id) for ep in eps.values() for ev in ep.events if ev.kind == "tokens")
    for eid, ep in eps.items():
        assert ep.status == "finished" and ep.reward_details["indices"] == [0, 1, 2]
        assert ep.reward == float(len(texts[eid]) == longest)
        # scored after the whole group generated
        assert order(ep.events[-1].entry_id) > last_token_event
