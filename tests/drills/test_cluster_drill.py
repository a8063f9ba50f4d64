"""Processes on a real 3-master Redis Cluster. A fault drill: a rollout worker killed -9 mid-generation, another
taking its groups over; every group sampled once, and `streamrl check`'s counts are 0 lost, 0 finished twice.
And tool calls as rq jobs when the run is on a cluster and rq on a single server of its own (rq_redis_url)."""

from __future__ import annotations

import pytest

from services.ops.check.checker import check, read_run
from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from tests.support.procs import kill9, spawn, stop, wait_until
from tests.support.rollout_harness import episodes, make_worker, samples, snapshot, tick_until

GROUPS = [(f"g{i}", 2) for i in range(6)]


def _worker_proc(cluster_url, rq_url, keys, model_dir, worker_id):
    return spawn(
        "services.rollout",
        "--worker-id",
        worker_id,
        "--run",
        keys.run,
        "--redis-url",
        cluster_url,
        "--rq-redis-url",
        rq_url,
        "--model-dir",
        model_dir,
        "--max-tokens",
        "48",
        "--tools",
        "",
        "--flush-tokens",
        "4",
        "--flush-ms",
        "20",
        "--heartbeat-ttl",
        "1.5",
        "--step-delay-ms",
        "15",
        "--max-groups-in-flight",
        "6",
        "--log-level",
        "warning",
    )


@pytest.mark.slow
def test_kill_9_on_a_cluster_another_worker_finishes_every_group_once(
    redis_cluster, cluster_client, redis_url, keys, tiny_model_dir
):
    client = cluster_client
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in GROUPS])
    a = _worker_proc(redis_cluster.url, redis_url, keys, tiny_model_dir, "A")
    try:
        wait_until(
            lambda: sum(len(ep.tokens) >= 8 and not ep.done for ep in snapshot(client, keys, GROUPS).values()) >= 6,
            "worker A generating 6 episodes",
            60,
            [a],
        )
    finally:
        kill9(a)
    before = snapshot(client, keys, GROUPS)
    assert len(samples(client, keys)) < len(GROUPS)
    shards = {client.get_node_from_key(keys.episode(eid)).name for eid in before}
    # the drill's episode streams are spread over the cluster
    assert len(shards) > 1
    b = _worker_proc(redis_cluster.url, redis_url, keys, tiny_model_dir, "B")
    try:
        wait_until(lambda: len(samples(client, keys)) == len(GROUPS), "B finishing every group", 90, [b])
    finally:
        stop(b)
    assert sorted(s["group_id"] for s in samples(client, keys)) == sorted(g for g, _ in GROUPS)
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    taken_over = 0
    for eid, ep in episodes(client, keys, GROUPS).items():
        assert ep.status == "finished" and sum(e.kind == "finished" for e in ep.events) == 1, eid
        if eid in before:
            # what A flushed stays
            assert ep.tokens[: len(before[eid].tokens)] == before[eid].tokens
            if not before[eid].done:
                assert ep.resumes and ep.resumes[0]["takeover_from"] == "A"
                taken_over += 1
    assert taken_over >= 6
    report = check(read_run(client, keys, Config(run=keys.run).run_path))
    assert report.groups_lost == 0 and report.episodes_finished_twice == 0
    assert report.ok, report


@pytest.mark.slow
def test_reward_jobs_run_on_rqs_own_server_when_the_run_is_on_a_cluster(
    redis_cluster, cluster_client, redis_url, client, keys, tiny_model_dir
):
    """rq jobs (here reward jobs: the same path as tool calls) on a single server of their own while the run is on
    the cluster: the worker's blocking read cannot include rq's result streams (another server), so it looks at
    its jobs every tool_jobs.CHECK_S instead; every episode is scored once, by the rq worker."""
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=8,
        tools="",
        reward_fn="tests.support.debug_tools:slow_reward",
        redis_url=redis_cluster.url,
        rq_redis_url=redis_url,
    )
    tools = spawn(
        "services.rollout.jobs.tools_worker",
        "--run",
        keys.run,
        "--redis-url",
        redis_cluster.url,
        "--rq-redis-url",
        redis_url,
        "--log-level",
        "warning",
        "--reward-fn",
        cfg.reward_fn,
    )
    try:
        enqueue(
            cluster_client, keys, [PromptGroup(f"r{i}", 2, prompt=f"{i}+1=", task={"sleep": "0.2"}) for i in range(3)]
        )
        worker = make_worker(cfg, cluster_client)
        assert worker.jobs.client is not cluster_client and not worker.jobs.wake_on_results
        tick_until(worker, lambda: len(samples(cluster_client, keys)) == 3, timeout=90)
    finally:
        stop(tools)
    eps = episodes(cluster_client, keys, [(f"r{i}", 2) for i in range(3)])
    assert all(ep.status == "finished" and ep.reward == 1.0 for ep in eps.values())
    assert all(sum(e.kind == "finished" for e in ep.events) == 1 for ep in eps.values())
    # one job per episode, on rq's server
    assert len(list(client.scan_iter(match=f"rq:job:{keys.run}-*"))) == 6
    # ... and nothing of rq's is on the cluster
    assert not list(cluster_client.scan_iter(match="rq:*"))
