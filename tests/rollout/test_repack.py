"""Long-tail repack through the log: a normal worker hands its long-tail groups to a long-tail
worker, which resumes them from their streams. Real Redis, real workers, the tiny model, the torch engine
(its sampling is a pure function of seed and position, so a resumed episode draws what an uninterrupted one
would)."""

from __future__ import annotations

import signal

import pytest

from services.ops.check.checker import check, read_run
from services.ops.inspect.views import format_timeline
from shared.protocol.keys import ROLLOUT_GROUP, Keys
from shared.protocol.streams import repacks
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime import faults
from shared.runtime.config.keys import Config
from tests.support.gateway_stack import env_for
from tests.support.procs import kill9, spawn, wait_until
from tests.support.rollout_harness import episodes, make_worker, samples, snapshot, worker_info

# max_tokens of the short groups and of the long one (the tiny model rarely stops early)
SHORT, LONG = 8, 48
# a group whose two episodes both run to LONG tokens on the tiny model (sampling seed 0)
LONG_GROUP = "long9"
GROUPS = [("s0", 2), ("s1", 2), ("s2", 2), (LONG_GROUP, 2)]
BASE = dict(
    tools="",
    max_tokens=SHORT,
    temperature=1.0,
    flush_tokens=4,
    flush_ms=20.0,
    heartbeat_ttl=1.0,
    max_groups_in_flight=4,
    group_size=2,
)
# capacity 8 episodes: repack once <= 4 generate
REPACK = dict(repack_below=0.5, repack_min_tokens=4)


def _enqueue(client, keys):
    enqueue(
        client,
        keys,
        [
            PromptGroup(g, n, prompt=f"{g}: 3*4=", sampling={"max_tokens": LONG if g == LONG_GROUP else SHORT})
            for g, n in GROUPS
        ],
    )


def _cfg(keys, model_dir, **kw) -> Config:
    return Config(run=keys.run, model_dir=model_dir, **{**BASE, **kw})


def _all_published(client, keys) -> bool:
    return len(samples(client, keys)) == len(GROUPS)


def _tick_all(workers, done, limit=20_000):
    for _ in range(limit):
        if done():
            return
        for w in workers:
            w.tick(block_ms=2)
    raise AssertionError(f"not done after {limit} rounds of ticks")


def _exactly_once(client, keys):
    assert sorted(s["group_id"] for s in samples(client, keys)) == sorted(g for g, _ in GROUPS)
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    report = check(read_run(client, keys, Config(run=keys.run).run_path))
    assert report.groups_lost == 0 and report.episodes_finished_twice == 0, report
    return report


def test_handoff_moves_the_entry_only_from_its_owner(client, keys):
    """The handoff script: the entry changes owner and the notice is written together, only while the source
    owns it; a retry (or a source the group was taken from) hands nothing."""
    enqueue(client, keys, [PromptGroup("g1", 2, prompt="x")])
    client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="0")
    [(_, [(entry, _)])] = client.xreadgroup(ROLLOUT_GROUP, "A", {keys.prompts: ">"}, count=1)
    notice = repacks.Repack(keys.prompts, entry.decode(), "g1", "A", "L", 2, 30, 5.0)
    assert repacks.handoff(client, keys, repacks.Repack(keys.prompts, entry.decode(), "g1", "B", "L")) is None
    assert repacks.handoff(client, keys, notice) is not None
    [p] = client.xpending_range(keys.prompts, ROLLOUT_GROUP, "-", "+", 10)
    assert p["consumer"].decode() == "L"
    # a retried handoff: already the target's
    assert repacks.handoff(client, keys, notice) is None
    [got], bad = repacks.read_all(client, keys)
    assert not bad and (got.group, got.source, got.target, got.tokens) == ("g1", "A", "L", 30)


def test_a_group_handed_over_is_opened_as_repacked_even_when_the_takeover_timer_runs_before_the_notice_is_read(
    client, keys, tiny_model_dir
):
    """the long-tail worker's take-over pass can run before its idle read brings the notice; the entry
    is pending under it then, and it must open it as a repacked group (its `resumed` events carry `repacked`),
    never as an orphan of its own."""
    enqueue(client, keys, [PromptGroup("g1", 2, prompt="g1: 3*4=")])
    # its cursor: before
    tail = make_worker(_cfg(keys, tiny_model_dir, rollout_role="longtail"), client, "L")
    [(_, [(entry, _)])] = client.xreadgroup(ROLLOUT_GROUP, "A", {keys.prompts: ">"}, count=1)
    assert repacks.handoff(client, keys, repacks.Repack(keys.prompts, entry.decode(), "g1", "A", "L", 2)) is not None
    # the timer first: the notice has not been read by any tick yet
    [run] = tail.claims.take_over()
    assert run.repack is not None and run.repack.source == "A" and run.takeover_from is None


def test_a_repacked_episode_gives_the_tokens_of_an_unrepacked_run_and_every_group_once(client, keys, tiny_model_dir):
    _enqueue(client, keys)
    plain = make_worker(_cfg(keys, tiny_model_dir), client, "P")
    _tick_all([plain], lambda: _all_published(client, keys))
    expected = episodes(client, keys, GROUPS)
    plain.shutdown()

    keys2 = Keys(keys.run + "r")
    _enqueue(client, keys2)
    a = make_worker(_cfg(keys2, tiny_model_dir, **REPACK), client, "A")
    # A holds every group, the long one included
    _tick_all([a], lambda: len(a.groups) == len(GROUPS))
    tail = make_worker(_cfg(keys2, tiny_model_dir, rollout_role="longtail"), client, "L")
    assert worker_info(client, keys2, "L")["role"] == "longtail"
    _tick_all([a, tail], lambda: _all_published(client, keys2))
    # counted once it is published
    _tick_all([tail], lambda: tail.stats["repack_saved_steps"] > 0, limit=50)

    got = episodes(client, keys2, GROUPS)
    for eid, ep in expected.items():
        assert got[eid].tokens == ep.tokens, eid
        assert got[eid].logprobs == pytest.approx(ep.logprobs, abs=2e-4)
    moved = {eid: got[eid] for eid in (f"{LONG_GROUP}-0", f"{LONG_GROUP}-1") if got[eid].aborts}
    assert len(moved) == 2
    for eid, ep in moved.items():
        assert [a["reason"] for a in ep.aborts] == ["repack"] and ep.aborts[0]["worker"] == "A"
        assert [(r["worker"], r["repacked"]) for r in ep.resumes] == [("L", "A")]
        cut = ep.resumes[0]["num_tokens"]
        # moved mid-generation, finished by L
        assert 4 <= cut < len(ep.tokens)
        assert {e.worker for e in ep.events if e.kind == "tokens" and e.seq > ep.resumes[0]["seq"]} == {"L"}
        # what `streamrl replay` prints
        assert "repacked from A" in format_timeline(ep)
    assert all(not ep.aborts for eid, ep in got.items() if eid not in moved)
    assert a.stats["repacks"] == 1 and a.stats["repacked_groups"] == 1
    assert a.stats["repacked_episodes"] == len(moved)
    assert a.stats["repacked_tokens"] == sum(ep.resumes[0]["num_tokens"] for ep in moved.values())
    assert tail.stats["repacked_in"] == 1
    assert tail.stats["repack_saved_steps"] == max(
        len(ep.tokens) - ep.resumes[0]["num_tokens"] for ep in moved.values()
    )
    [notice], _ = repacks.read_all(client, keys2)
    assert (notice.group, notice.source, notice.target, notice.episodes) == (LONG_GROUP, "A", "L", len(moved))
    assert tail.stats["repack_saved_s"] == pytest.approx(tail.stats["repack_saved_steps"] * notice.step_ms / 1000)
    a.shutdown()
    # final reports: every token each worker generated is counted
    tail.shutdown()
    report = _exactly_once(client, keys2)
    # a repack flushes everything first: nothing is generated twice
    assert report.tokens_generated_again == 0


def _worker_env(redis_url, keys, model_dir, **kw):
    env = env_for(redis_url, keys, model_dir, **{**BASE, "step_delay_ms": 5, **kw})
    return {k: v for k, v in env.items() if k != faults.ENV}


@pytest.mark.slow
@pytest.mark.parametrize("point", ["repack_stopped", "repack_handed"])
def test_a_source_killed_mid_repack_loses_no_group_and_publishes_none_twice(
    client, keys, redis_url, tiny_model_dir, point
):
    """A kills itself (SIGKILL) after the repack's aborts are flushed (entry still A's: taken over when A's
    heartbeat lapses), or right after the handoff (entry L's: opened as a repacked group)."""
    _enqueue(client, keys)
    tail = make_worker(_cfg(keys, tiny_model_dir, rollout_role="longtail", longtail_claim_share=0.0), client, "L")
    a = spawn(
        "services.rollout",
        "--worker-id",
        "A",
        env={**_worker_env(redis_url, keys, tiny_model_dir, **REPACK), **faults.spec("rollout", point)},
    )
    try:
        wait_until(lambda: tail.tick(block_ms=2) or a.poll() is not None, "A reaching the crash point", 120)
        assert a.returncode == -signal.SIGKILL
    finally:
        kill9(a)
    before = snapshot(client, keys, GROUPS)
    moved = [eid for eid, ep in before.items() if ep.aborts]
    assert moved and all([ab["reason"] for ab in before[eid].aborts] == ["repack"] for eid in moved)
    _tick_all([tail], lambda: _all_published(client, keys))
    after = episodes(client, keys, GROUPS)
    for eid, ep in after.items():
        assert ep.done, eid
        # what A wrote stays, unchanged
        if eid in before:
            assert ep.tokens[: len(before[eid].tokens)] == before[eid].tokens, eid
    for eid in moved:
        first = after[eid].resumes[0]
        # the entry was L's: opened as a repacked group
        if point == "repack_handed":
            assert (first["worker"], first["repacked"], first["takeover_from"]) == ("L", "A", None)
        # still A's: taken over once A's heartbeat lapsed
        else:
            assert (first["worker"], first["repacked"], first["takeover_from"]) == ("L", None, "A")
    _exactly_once(client, keys)


@pytest.mark.slow
def test_a_longtail_worker_killed_after_a_repack_is_taken_over_again(client, keys, redis_url, tiny_model_dir, tmp_path):
    _enqueue(client, keys)
    a = make_worker(_cfg(keys, tiny_model_dir, **REPACK), client, "A")
    _tick_all([a], lambda: len(a.groups) == len(GROUPS))
    tail = spawn(
        "services.rollout",
        "--worker-id",
        "L",
        env=_worker_env(
            redis_url,
            keys,
            tiny_model_dir,
            rollout_role="longtail",
            longtail_claim_share=0.0,
            # slow: killed mid-episode
            step_delay_ms=100,
        ),
        log=tmp_path / "L.log",
    )
    try:
        wait_until(lambda: worker_info(client, keys, "L").get("role") == "longtail", "L up", 120, [tail])

        # L has resumed a repacked episode and written tokens of its own
        def l_generating():
            a.tick(block_ms=2)
            return [
                eid
                for eid, ep in snapshot(client, keys, [(LONG_GROUP, 2)]).items()
                if ep.resumes and len(ep.tokens) > ep.resumes[0]["num_tokens"] + 4 and not ep.done
            ]

        moved = wait_until(l_generating, "L generating the repacked episodes", 120, [tail])
    finally:
        kill9(tail)
    assert a.stats["repacked_groups"] == 1
    _tick_all([a], lambda: _all_published(client, keys))
    ep = episodes(client, keys, GROUPS)[moved[0]]
    assert [(r["worker"], r["repacked"], r["takeover_from"]) for r in ep.resumes] == [
        ("L", "A", None),
        ("A", None, "L"),
    ]
    assert ep.done and len(ep.tokens) == LONG
    assert a.stats["takeovers"] >= 1
    _exactly_once(client, keys)
