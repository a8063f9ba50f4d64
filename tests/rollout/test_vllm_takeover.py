"""Crash takeover and abort/resume of the rollout worker on vLLM.

Worker A is a real ``python -m services.rollout --engine vllm`` process, killed
with SIGKILL mid-episodes; worker B (in this process, on one vLLM engine) takes
its groups over from the streams, is paused and resumed on the way, and
finishes them all.
"""

from __future__ import annotations

import importlib.util

import pytest

from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from tests.support.procs import kill9, spawn, wait_until
from tests.support.rollout_harness import (
    acks,
    episodes,
    make_vllm_engine,
    make_worker,
    samples,
    send,
    snapshot,
    tick_until,
    wait_claimable,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm not installed (CI runs it in its own venv)"
    ),
]

GROUPS = [(f"g{i}", 2) for i in range(4)]
MAX_TOKENS = 48


def _worker_proc(redis_url, keys, model_dir, worker_id):
    return spawn(
        "services.rollout",
        "--worker-id",
        worker_id,
        "--run",
        keys.run,
        "--redis-url",
        redis_url,
        "--model-dir",
        model_dir,
        "--engine",
        "vllm",
        "--temperature",
        "0",
        "--max-tokens",
        MAX_TOKENS,
        "--tools",
        "",
        "--flush-tokens",
        "4",
        "--flush-ms",
        "20",
        "--heartbeat-ttl",
        "1.5",
        "--step-delay-ms",
        "40",
        "--max-groups-in-flight",
        "4",
        "--log-level",
        "warning",
    )


def _snapshot(client, keys):
    return snapshot(client, keys, GROUPS)


def test_kill_9_a_vllm_worker_then_another_takes_over_through_a_pause(client, keys, redis_url, tiny_model_dir_hd32):
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in GROUPS])
    a = _worker_proc(redis_url, keys, tiny_model_dir_hd32, "A")
    engine = None
    try:
        # B's engine starts while A starts
        engine = make_vllm_engine(tiny_model_dir_hd32)
        wait_until(
            lambda: sum(len(ep.tokens) >= 8 and not ep.done for ep in _snapshot(client, keys).values()) >= 4,
            "worker A generating 4 episodes",
            150,
            [a],
        )
    finally:
        kill9(a)
    try:
        before = _snapshot(client, keys)
        assert len(samples(client, keys)) < len(GROUPS)
        # A's groups idle past its heartbeat's TTL
        wait_claimable(client, keys, "A", 1.5)
        cfg = Config(
            run=keys.run,
            model_dir=tiny_model_dir_hd32,
            engine="vllm",
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            tools="",
            flush_tokens=4,
            flush_ms=20.0,
            heartbeat_ttl=1.5,
        )
        b = make_worker(cfg, client, "B", engine=engine)
        paused = []

        def pause_once(tick):
            if not paused and b.stats["tokens"] >= 20:
                send(client, keys, "pause", sync="p1")
                send(client, keys, "resume", sync="r1")
                paused.append(tick)

        tick_until(b, lambda: len(samples(client, keys)) == len(GROUPS), timeout=120, on_tick=pause_once)
    finally:
        if engine is not None:
            engine.close()
    assert paused and len(acks(client, keys, "pause")) == 1
    got = [s["group_id"] for s in samples(client, keys)]
    # every group exactly once
    assert sorted(got) == sorted(g for g, _ in GROUPS)
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    after = episodes(client, keys, GROUPS)
    taken_over = paused_eps = resumed_at_abort = 0
    for eid, ep in after.items():
        assert ep.status == "finished"
        assert sum(e.kind == "finished" for e in ep.events) == 1
        assert len(ep.tokens) == ep.num_generated <= MAX_TOKENS
        assert set(ep.versions) == {0}
        old = before.get(eid)
        # every token flushed before the kill is still there, unchanged
        if old is not None:
            assert ep.tokens[: len(old.tokens)] == old.tokens
            assert ep.logprobs[: len(old.logprobs)] == old.logprobs
            if not old.done:
                assert ep.resumes[0]["takeover_from"] == "A"
                # A may have flushed more before dying
                assert ep.resumes[0]["num_tokens"] >= len(old.tokens)
                taken_over += 1
        # B's pause: the resume continues exactly at the abort, nothing generated twice
        for ab in ep.aborts:
            nxt = next((r for r in ep.resumes if r["seq"] > ab["seq"]), None)
            # B resumed its own pause
            if nxt is not None and nxt["takeover_from"] is None:
                assert nxt["num_tokens"] == ab["num_tokens"] and nxt["worker"] == ab["worker"]
                resumed_at_abort += 1
        paused_eps += bool(ep.aborts)
    assert taken_over >= 4
    assert paused_eps >= 1
    # the check above ran
    assert resumed_at_abort >= 1
