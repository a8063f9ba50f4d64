"""Agent episodes: with ``agent = "module:function"`` set, the driver hands each
prompt group to the agents workers as rq jobs (one per episode) instead of to
the rollout workers' prompts stream. The job function is named by its import
path: the driver never imports the gateway package (services are siblings).

A group goes through the staleness gate like a prompt group (the driver reserves
its slot, named by the group id, before enqueueing; a closed gate waits) and is
recorded once in the ``prompts:agents`` stream (the prompts codec), so
``streamrl check`` counts agent groups enqueued, in flight and lost as it counts
prompt groups. The record comes before the jobs: a driver dying in between
leaves a group the check reports lost, never a silent gap. Jobs are enqueued
again on a repeat (same job ids): a job that runs twice is answered from its
episode stream and publishes once."""

from __future__ import annotations

from rq import Queue
from rq.serializers import JSONSerializer

from shared.protocol.gate import Gate
from shared.protocol.keys import Keys
from shared.protocol.streams.prompts import PromptGroup, enqueue

JOB = "services.gateway.runner.run_episode"


def job_id(run: str, episode_id: str, attempt: int = 0) -> str:
    return f"{run}-{episode_id}" + (f"-r{attempt}" if attempt else "")


def group_specs(cfg, group_id: str, task: dict, n: int) -> list[dict]:
    """The job specs of one group's agent episodes (JSON: rq runs them with the JSON serializer)."""
    episodes = [f"{group_id}-{i}" for i in range(n)]
    return [
        {
            "run": cfg.run,
            "episode_id": eid,
            "group_id": group_id,
            "index": i,
            "episodes": episodes,
            "task": task,
            "agent": cfg.agent,
            "gateway_url": cfg.agent_gateway_url,
            "timeout": cfg.agent_timeout,
            "attempt": 0,
            "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens},
        }
        for i, eid in enumerate(episodes)
    ]


def queue(client, keys: Keys) -> Queue:
    return Queue(keys.agent_queue, connection=client, serializer=JSONSerializer)


def enqueue_group(cfg, client, keys: Keys, group_id: str, task: dict, n: int, rq_client=None) -> list[str] | None:
    """Reserve the group's gate slot, record the group, enqueue its episodes' jobs (on ``rq_client``, default
    ``client``): their ids, or None when the gate is closed (nothing recorded or enqueued; try again after the
    next sync)."""
    grant = Gate(client, keys, sync_mode=cfg.mode == "sync").reserve(1, token=f"group:{group_id}")
    if not grant.granted:
        return None
    rest = {k: v for k, v in task.items() if k != "prompt"}
    enqueue(
        client, keys, [PromptGroup(group_id, n, prompt=task.get("prompt", ""), task=rest)], stream=keys.agent_groups
    )
    q = queue(rq_client or client, keys)
    jobs = [
        Queue.prepare_data(
            JOB,
            args=(spec,),
            job_id=job_id(cfg.run, spec["episode_id"]),
            timeout=int(cfg.agent_timeout) + 60,
            result_ttl=3600,
            failure_ttl=86400,
        )
        for spec in group_specs(cfg, group_id, task, n)
    ]
    return [j.id for j in q.enqueue_many(jobs)]


def waiting_groups(cfg, client, keys: Keys) -> int:
    """Groups whose agent jobs wait for a worker (about: jobs waiting / group size)."""
    return len(queue(client, keys)) // max(cfg.group_size, 1)
