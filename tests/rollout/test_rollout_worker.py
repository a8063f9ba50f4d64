"""Rollout worker behaviour: groups, tools as real rq jobs, pause, bad input."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams import dead_letters
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from tests.support import debug_tools
from tests.support.models import scripted_model
from tests.support.procs import stop
from tests.support.rollout_harness import (
    acks,
    episodes,
    make_worker,
    samples,
    send,
    start_tools_worker,
    tick_until,
    # a pytest fixture, named as the tests' argument
    tools_worker,  # noqa: F401
    wait_claimable,
)

SCRIPTS = [
    ("S:", "<call>sleep: 2</call><result>2</result>answer: 2"),
    ("C:", "<call>calc: 6*7</call><result>42</result>answer: 42"),
    ("X:", "<call>crash: boom</call><result>x</result>answer: 0"),
    ("H:", "<call>sleep: 30</call><result>x</result>answer: 0"),
    ("U:", "<call>teleport: 1</call><result>x</result>answer: 0"),
    ("M:", "<call>no colon here</call><result>x</result>answer: 0"),
    ("G:", "<call>garbage: 1</call><result>x</result>answer: 0"),
]


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory) -> str:
    return scripted_model(tmp_path_factory.mktemp("scripted"), SCRIPTS)


def _cfg(keys, model_dir, **kw) -> Config:
    base = dict(
        run=keys.run,
        model_dir=model_dir,
        max_tokens=80,
        temperature=0.0,
        tools="calc," + debug_tools.SPECS,
        tool_timeout=1.5,
        flush_tokens=8,
        heartbeat_ttl=2.0,
    )
    return Config(**{**base, **kw})


def _tool_outcome(ep):
    return [(r["ok"], r["output"]) for r in ep.tool_results]


def test_group_finishes_once_with_sample_and_ack(client, keys, tiny_model_dir):
    cfg = Config(run=keys.run, model_dir=tiny_model_dir, max_tokens=16, tools="")
    enqueue(client, keys, [PromptGroup("g1", 4, prompt="1+1="), PromptGroup("g2", 2, prompt_ids=[20, 21])])
    worker = make_worker(cfg, client)
    tick_until(worker, lambda: len(samples(client, keys)) == 2)
    got = {s["group_id"]: s for s in samples(client, keys)}
    assert got["g1"]["episodes"] == "g1-0,g1-1,g1-2,g1-3" and got["g2"]["n"] == "2"
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    eps = episodes(client, keys, [("g1", 4), ("g2", 2)])
    assert all(ep.status == "finished" and 0 < ep.num_generated <= 16 for ep in eps.values())
    assert eps["g2-0"].prompt_ids == [20, 21]
    # each episode of a group has its own seed: a group is not n copies of one answer
    assert len({tuple(eps[f"g1-{i}"].tokens) for i in range(4)}) > 1


def test_tools_run_as_rq_jobs_and_errors_become_results(client, keys, scripted_dir, tools_worker):
    cfg = _cfg(keys, scripted_dir)
    tools_worker(cfg)
    groups = [(p[0], 1) for p, _ in SCRIPTS if p[0] != "S"]
    enqueue(client, keys, [PromptGroup(g, 1, prompt=f"{g}:", task={"answer": "42"}) for g, _ in groups])
    worker = make_worker(cfg, client)
    tick_until(worker, lambda: len(samples(client, keys)) == len(groups), timeout=90)
    eps = {eid.split("-")[0]: ep for eid, ep in episodes(client, keys, groups).items()}
    assert _tool_outcome(eps["C"]) == [(True, "42")]
    assert eps["C"].reward == 1.0 and eps["C"].status == "finished"
    ok, out = _tool_outcome(eps["X"])[0]
    assert not ok and "crash tool asked to fail: boom" in out
    ok, out = _tool_outcome(eps["H"])[0]
    assert not ok and "timed out" in out
    assert _tool_outcome(eps["U"]) == [(False, "unknown tool 'teleport'; available: calc, crash, garbage, sleep")]
    ok, out = _tool_outcome(eps["M"])[0]
    assert not ok and "malformed tool call" in out
    ok, out = _tool_outcome(eps["G"])[0]
    assert not ok and "returned dict, expected str" in out
    # every episode went on after its tool result, and tool tokens are masked
    for ep in eps.values():
        assert ep.status == "finished"
        result_tokens = ep.tool_results[0]["num_tokens"]
        assert result_tokens > 0 and ep.mask.count(0) == result_tokens


def test_tool_job_completes_during_a_pause(client, keys, scripted_dir, tools_worker):
    cfg = _cfg(keys, scripted_dir, tool_timeout=10.0)
    tools_worker(cfg)
    enqueue(client, keys, [PromptGroup("S", 1, prompt="S:")])
    worker = make_worker(cfg, client)
    log = EpisodeLog(client, keys, "reader")
    tick_until(worker, lambda: worker.waiting_on_jobs())
    send(client, keys, "pause")
    tick_until(worker, lambda: worker.paused)
    # paused while the 2-s tool still runs
    assert not log.replay("S-0").tool_results
    tick_until(worker, lambda: log.replay("S-0").tool_results, timeout=20)
    # ... and it finished while paused
    assert worker.paused
    assert not worker.engine.has_unfinished()
    send(client, keys, "resume")
    tick_until(worker, lambda: len(samples(client, keys)) == 1)
    ep = log.replay("S-0")
    assert _tool_outcome(ep) == [(True, "2")] and ep.status == "finished"
    kinds = [e.kind for e in ep.events]
    assert kinds.index("tool_result") < kinds.index("resumed")


def test_a_takeover_with_a_tool_call_pending_reattaches_to_its_job_and_answers_it_once(
    client, keys, redis_url, scripted_dir
):
    """A dies after its episode's tool call is in the stream and its rq job queued, before any tools worker ran
    it. B takes the group over, re-attaches to that same job (not a second one), writes its one result, and
    finishes the episode."""
    from rq.job import Job

    cfg = _cfg(keys, scripted_dir, heartbeat_ttl=0.5, tool_timeout=30.0)
    enqueue(client, keys, [PromptGroup("C", 1, prompt="C:", task={"answer": "42"})])
    log = EpisodeLog(client, keys, "reader")
    a = make_worker(cfg, client, "A")
    # no tools worker yet: the job waits in rq
    tick_until(a, lambda: client.exists(keys.episode("C-0")) and log.replay("C-0").pending_tool_calls)
    (call,) = log.replay("C-0").pending_tool_calls
    job_id = a.jobs.pending["C-0"].job_id
    enqueued_at = Job.fetch(job_id, connection=client).enqueued_at
    # A is gone (what its heartbeat's TTL does after a kill -9)
    client.delete(keys.alive("rollout", "A"))
    wait_claimable(client, keys, "A", cfg.heartbeat_ttl)
    tools = start_tools_worker(redis_url, keys, cfg)
    try:
        b = make_worker(cfg, client, "B")
        tick_until(b, lambda: len(samples(client, keys)) == 1, timeout=90)
    finally:
        stop(tools)
    ep = log.replay("C-0")
    assert ep.resumes[0]["takeover_from"] == "A"
    assert [(r["call_id"], r["ok"], r["output"]) for r in ep.tool_results] == [(call["call_id"], True, "42")]
    assert ep.status == "finished" and ep.reward == 1.0
    # A's job, run once, not enqueued again
    assert Job.fetch(job_id, connection=client).enqueued_at == enqueued_at


def test_prompt_too_long_fails_the_episode_not_the_worker(client, keys, tiny_model_dir):
    cfg = Config(run=keys.run, model_dir=tiny_model_dir, max_tokens=8, tools="")
    enqueue(client, keys, [PromptGroup("long", 2, prompt_ids=[5] * 5000), PromptGroup("ok", 1, prompt="hi")])
    worker = make_worker(cfg, client)
    tick_until(worker, lambda: len(samples(client, keys)) == 2)
    eps = episodes(client, keys, [("long", 2), ("ok", 1)])
    assert eps["long-0"].status == "failed" and "does not fit the model's context" in eps["long-0"].error
    assert eps["ok-0"].status == "finished"


def test_malformed_input_goes_to_dead_letters(client, keys, tiny_model_dir):
    cfg = Config(run=keys.run, model_dir=tiny_model_dir, max_tokens=8, tools="")
    worker = make_worker(cfg, client)
    client.xadd(keys.prompts, {"group_id": "bad", "n": "two", "data": b"\x80"})
    client.xadd(keys.prompts, {"group_id": "bad2", "n": "1", "data": b"\xc1"})
    client.xadd(keys.control, {"type": "cmd", "cmd": "explode", "sync": "x"})
    client.xadd(keys.control, {"nonsense": "1"})
    enqueue(client, keys, [PromptGroup("fine", 1, prompt="x")])
    tick_until(worker, lambda: len(samples(client, keys)) == 1)
    dead = [asdict(d) for d in dead_letters.read_all(client, keys)]
    reasons = " | ".join(d["reason"] for d in dead)
    assert len(dead) == 4
    assert "field 'n'" in reasons and "field 'data'" in reasons and "field 'cmd'" in reasons
    assert "field 'type'" in reasons
    # bad entries are acked, not retried forever
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0


def test_corrupt_weights_are_refused_and_old_version_kept(client, keys, tiny_model_dir, tmp_path):
    cfg = Config(run=keys.run, model_dir=tiny_model_dir, max_tokens=8, tools="")
    worker = make_worker(cfg, client)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not weights at all")
    send(client, keys, "pause")
    send(client, keys, "load", version=3, path=str(bad), sha256="0" * 64)
    send(client, keys, "resume")
    tick_until(worker, lambda: len(acks(client, keys, "resume")) == 1)
    (ack,) = acks(client, keys, "load")
    assert ack["ok"] == "0" and "sha256" in ack["error"] and ack["version"] == "0"
    assert worker.engine.version == 0 and not worker.paused


def test_commands_of_an_older_sync_are_acknowledged_and_never_load_an_older_version(
    client, keys, tiny_model_dir, tmp_path
):
    """a worker that caught up to version 2 (here at start) then reads the queued fetch, pause, load and
    resume of version 1's sync (a rolling wave it missed while stalled): each is acked ok and ignored, so it never
    loads version 1 and is never left paused; a pause with no version (a person's) is still obeyed, and a load of
    an older version asked for directly is refused."""
    from services.trainer.publish import publish
    from tests.support.models import nudged_weights

    old_path, old_sha = nudged_weights(tiny_model_dir, tmp_path / "v1", 1)
    publish(client, keys, 2, *nudged_weights(tiny_model_dir, tmp_path / "v2", 2), step=2)
    enqueue(client, keys, [PromptGroup("g", 2, prompt="1+1=")])
    worker = make_worker(
        Config(run=keys.run, model_dir=tiny_model_dir, max_tokens=64, tools="", flush_tokens=4), client
    )
    assert worker.engine.version == 2
    for cmd in ("fetch", "pause", "load", "resume"):
        send(client, keys, cmd, "old-sync", version=1, path=str(old_path), sha256=old_sha)
    tick_until(worker, lambda: acks(client, keys, "resume"))
    for cmd in ("fetch", "pause", "load", "resume"):
        (ack,) = acks(client, keys, cmd)
        assert ack["ok"] == "1" and ack["version"] == "2", (cmd, ack)
    assert worker.engine.version == 2 and not worker.paused
    # it went on generating, on version 2
    tick_until(worker, lambda: len(samples(client, keys)) == 1)
    assert {v for ep in episodes(client, keys, [("g", 2)]).values() for v in ep.versions} == {2}
    send(client, keys, "pause", "by-hand")
    tick_until(worker, lambda: worker.paused)
    with pytest.raises(ValueError, match="version 1 is older than the one this worker runs"):
        worker._load(1, str(old_path), old_sha)
    assert worker.engine.version == 2
