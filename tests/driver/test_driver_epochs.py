"""The driver feeds `epochs` passes over the rows, each shuffled with the run's seed, then ends the run once
every group is rolled out and read by the trainer."""

from __future__ import annotations

import json

from services.driver.driver import Driver
from shared.protocol.keys import ROLLOUT_GROUP, TRAINER_GROUP
from shared.protocol.streams.prompts import decode_group
from shared.runtime.config.keys import Config


def test_epochs_feed_every_row_once_per_epoch_then_end(client, keys, redis_url, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(5)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = Config(
        run=keys.run,
        redis_url=redis_url,
        run_dir=str(tmp_path / "runs"),
        dataset=str(tmp_path / "rows.jsonl"),
        epochs=2,
        val_every=0,
        group_size=2,
        batch_groups=2,
        seed=4,
    )
    driver = Driver(cfg)
    driver.top_up(depth=100)
    driver.top_up(depth=100)
    entries = client.xrange(keys.prompts)
    groups = [decode_group(e, f) for e, f in entries]
    # 2 epochs x 5 rows, and no more however deep the queue may be
    assert len(groups) == 10
    answers = [g.task["answer"] for g in groups]
    assert sorted(answers[:5]) == sorted(answers[5:]) == ["1", "2", "3", "4", "5"]
    # chat prompts travel as messages
    assert groups[0].prompt == rows[int(answers[0]) - 1]["messages"]
    assert not driver.epochs_done()
    client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="0")
    delivered = client.xreadgroup(ROLLOUT_GROUP, "w", {keys.prompts: ">"}, count=100)[0][1]
    client.xgroup_create(keys.samples, TRAINER_GROUP, id="0", mkstream=True)
    # delivered, not rolled out yet
    assert not driver.epochs_done()
    client.xack(keys.prompts, ROLLOUT_GROUP, *[e for e, _ in delivered])
    client.xadd(keys.samples, {"group_id": "q0000009", "episodes": "x", "worker": "w", "n": "2"})
    # the trainer has not read it
    assert not driver.epochs_done()
    client.xreadgroup(TRAINER_GROUP, "trainer", {keys.samples: ">"}, count=100)
    # one group pending < batch_groups: it can never fill a step
    assert driver.epochs_done()


def test_agent_runs_get_the_same_rows_and_group_ids_as_rq_jobs(client, keys, redis_url, tmp_path):
    """With ``agent`` set, the driver enqueues each group's episodes as agent jobs (not prompt groups), with the
    rows and the epoch/position group ids prompt groups would have had."""
    from services.driver import agents
    from shared.protocol.streams import prompts

    rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(3)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = Config(
        run=keys.run,
        redis_url=redis_url,
        run_dir=str(tmp_path / "runs"),
        dataset=str(tmp_path / "rows.jsonl"),
        val_every=0,
        group_size=2,
        shuffle=False,
        agent="examples.calc:agent",
    )
    Driver(cfg).top_up(depth=4)
    jobs = agents.queue(client, keys).get_jobs()
    specs = [job.args[0] for job in jobs]
    # 4 groups x 2 episodes, none on the prompts stream
    assert client.xlen(keys.prompts) == 0 and len(specs) == 8
    group_ids = [prompts.group_id(0, 0), prompts.group_id(0, 1), prompts.group_id(0, 2), prompts.group_id(1, 0)]
    assert [s["group_id"] for s in specs[::2]] == group_ids
    assert [s["task"]["answer"] for s in specs[::2]] == [1, 2, 3, 1] and specs[1]["episode_id"] == f"{group_ids[0]}-1"


def test_an_agent_run_enqueues_no_validation_round_and_a_plain_run_does(client, keys, redis_url, tmp_path):
    """A validation round would roll the held-out prompts out without the agent (a figure about another task): an
    agent run has none, the same config without the agent has its rounds."""
    rows = [{"prompt": f"{i}+{j}=", "answer": i + j} for i in range(10) for j in range(10)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    common = dict(redis_url=redis_url, run_dir=str(tmp_path / "runs"), dataset=str(tmp_path / "rows.jsonl"))
    agent = Driver(Config(run=keys.run, val_every=5, agent="examples.calc:agent", **common))
    assert agent.validator.maybe_request(5) is False and client.xlen(agent.keys.val_prompts) == 0
    plain = Driver(Config(run=keys.run + "-plain", val_every=5, **common))
    assert plain.validator.maybe_request(5) is True and client.xlen(plain.keys.val_prompts) > 0


def test_agent_groups_pass_the_staleness_gate_and_are_recorded_once(client, keys, redis_url, tmp_path):
    """An agent group takes a gate slot before its jobs are enqueued (a closed gate enqueues nothing) and is
    recorded in ``prompts:agents`` once, so the check can count it; enqueueing it again records nothing new."""
    from services.driver import agents
    from shared.protocol import gate
    from shared.protocol.streams import prompts

    rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(5)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = Config(
        run=keys.run,
        redis_url=redis_url,
        run_dir=str(tmp_path / "runs"),
        dataset=str(tmp_path / "rows.jsonl"),
        val_every=0,
        group_size=2,
        shuffle=False,
        agent="examples.calc:agent",
        mode="sync",
        max_staleness=0,
    )
    driver = Driver(cfg)
    driver.top_up(depth=4)
    # sync mode, no gate yet: nothing starts
    assert len(agents.queue(client, keys)) == 0 and driver.enqueued == 0
    gate.open(client, keys, version=0, limit=3, max_staleness=0)
    driver.top_up(depth=4)
    assert driver.enqueued == 3 and gate.started(client, keys) == 3 and len(agents.queue(client, keys)) == 6
    recorded = [prompts.decode_group(e, f).group_id for e, f in client.xrange(keys.agent_groups)]
    assert recorded == [prompts.group_id(0, i) for i in range(3)]
    # a repeat
    assert agents.enqueue_group(cfg, client, keys, prompts.group_id(0, 0), dict(rows[0]), 2) is not None
    # neither recorded nor counted again
    assert client.xlen(keys.agent_groups) == 3 and gate.started(client, keys) == 3
    from services.ops.check.checker import check
    from services.ops.check.data import read_run

    report = check(read_run(client, keys, tmp_path / "runs" / keys.run))
    # jobs wait in rq
    assert (report.groups_enqueued, report.groups_in_flight, report.groups_lost) == (3, 3, 0)
    job = agents.queue(client, keys).get_jobs()[0]
    # one episode of the first group runs
    client.hset(keys.agents_running, job.args[0]["episode_id"], "{}")
    # the rest vanish: their groups are lost, the running one is in hand
    agents.queue(client, keys).empty()
    report = check(read_run(client, keys, tmp_path / "runs" / keys.run))
    assert report.details["groups_lost_in_rollout"] == [prompts.group_id(0, 1), prompts.group_id(0, 2)]
