"""Processes for gateway tests: real rollout workers, gateways and agents workers
as subprocesses (so they can be killed -9), or a gateway served in-process."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from contextlib import contextmanager

import httpx
import uvicorn

from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import Keys
from tests.support.procs import ROOT, wait_until

# where a test session's stacks make their run folders (set by tests/conftest.py; not STREAMRL_*: those are config keys)
SCRATCH_ENV = "TESTS_STACK_SCRATCH"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(redis_url: str, keys: Keys, model_dir: str, **cfg) -> dict:
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "STREAMRL_RUN": keys.run,
        "STREAMRL_MODEL_DIR": model_dir,
        "STREAMRL_LOG_LEVEL": "warning",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": ROOT,
        # the run's folder is the test's own: a run name reused by another test session meets no old state. It is
        # made under the session's temp folder (pytest's, kept for the last few sessions), not loose in /tmp.
        "STREAMRL_RUN_DIR": tempfile.mkdtemp(prefix=f"streamrl-{keys.run}-", dir=os.environ.get(SCRATCH_ENV)),
    }
    for k, v in cfg.items():
        env[f"STREAMRL_{k.upper()}"] = str(v)
    return env


def wait_http(port: int, timeout: float = 90.0) -> None:
    def up():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, f"gateway on port {port}", timeout)


def wait_alive(client, keys: Keys, service: str, worker_id: str, timeout: float = 120.0) -> None:
    wait_until(lambda: client.exists(keys.alive(service, worker_id)), f"{service} {worker_id} alive", timeout)


def start_agent_episode(client, keys: Keys, episode_id: str, task: dict | None = None, agent: str = "test:agent"):
    """What the agent runner writes first: the episode's 'started' event (prompts come with calls)."""
    log = EpisodeLog(client, keys, "test-runner")
    log.open(episode_id)
    log.append(
        episode_id,
        "started",
        {
            "episode_id": episode_id,
            "group_id": episode_id.rsplit("-", 1)[0],
            "index": 0,
            "prompt_ids": [],
            "sampling": {"temperature": 0.0},
            "task": task or {},
            "agent": agent,
        },
        0,
    )
    log.flush_or_raise()


def episode(client, keys: Keys, episode_id: str):
    return fold(client.xrange(keys.episode(episode_id)))


class InProcessGateway:
    """The gateway app on a free loopback port, served by uvicorn in a thread."""

    def __init__(self, gw, api_key: str = ""):
        from services.gateway.app import make_app

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(make_app(gw, api_key), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started, "in-process gateway", 30)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def base_url(self, episode_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/ep/{episode_id}/v1"


@contextmanager
def live_stack(redis_url: str, chat_dir, run: str, worker_id: str, step_delay_ms: int = 20):
    """One run for a gateway test module: a rollout worker subprocess (``step_delay_ms`` per decode step, so a sync
    can land mid-call) and an in-process gateway, both greedy unless a request says otherwise. Yields what the tests
    read: client, keys, gw (the InProcessGateway), env (the worker's), dir and url."""
    from services.gateway.__main__ import build
    from shared.runtime import logs
    from shared.runtime.config.keys import Config
    from shared.runtime.connection import connect
    from tests.support.procs import spawn, stop

    client = connect(redis_url)
    keys = Keys(run)
    env = env_for(redis_url, keys, chat_dir, heartbeat_ttl=2, step_delay_ms=step_delay_ms, temperature=0)
    worker = spawn("services.rollout", "--worker-id", worker_id, env=env)
    cfg = Config(
        run=keys.run, model_dir=chat_dir, redis_url=redis_url, gateway_timeout=120, temperature=0.0, max_tokens=96
    )
    try:
        with InProcessGateway(build(cfg, client, logs.get("gateway-test"))) as gw:
            wait_alive(client, keys, "rollout", worker_id)
            yield {"client": client, "keys": keys, "gw": gw, "env": env, "dir": chat_dir, "url": redis_url}
    finally:
        stop(worker)


def gateway_killed_under_a_streamed_agent(stack: dict, chat_dir, agent: str, group: str, task: dict):
    """The drill every API's streamed route takes: an agents worker runs ``agent`` (whose calls stream) for one
    episode of ``group``; the gateway is killed -9 while the first call streams and another starts. Asserts that
    the episode finishes with reward 1, nothing failed, each call made and requested once, and the runner ran the
    agent again; returns the episode for the caller's own checks."""
    from services.driver import agents as driver_agents
    from shared.protocol.streams import calls as calls_codec
    from shared.runtime.config.keys import Config
    from tests.support.procs import kill9, spawn, stop

    client, keys, eid = stack["client"], stack["keys"], f"{group}-0"
    port = free_port()
    gateway_env = env_for(stack["url"], keys, chat_dir, gateway_port=port, gateway_timeout=120)
    gateway = spawn("services.gateway", env=gateway_env)
    wait_http(port)
    cfg = Config(run=keys.run, agent=agent, gateway_port=port, temperature=0, heartbeat_ttl=2, group_size=1)
    env = env_for(stack["url"], keys, chat_dir, heartbeat_ttl=2, agent=cfg.agent, gateway_port=port)
    agents = spawn("services.gateway.agents_worker", "--worker-id", f"ag-{group}", env=env)
    try:
        driver_agents.enqueue_group(cfg, client, keys, group, task, 1)

        def streaming() -> bool:
            call = episode(client, keys, eid).calls.get(0) if client.exists(keys.episode(eid)) else None
            return call is not None and len(call.tokens) >= 4

        wait_until(streaming, what="the first call streaming")
        assert not episode(client, keys, eid).calls[0].done
        kill9(gateway)
        gateway = spawn("services.gateway", env=gateway_env)
        wait_until(lambda: client.exists(keys.sampled(group)), timeout=120, what="group published")
        ep = episode(client, keys, eid)
        assert ep.status == "finished" and ep.reward == 1.0, [(e.kind, e.data.get("call")) for e in ep.events]
        assert not [e for e in ep.events if e.kind == "failed"]
        # each call made once: the rerun's calls were answered from the stream, the cut one whole
        made = sorted(e.data["call"] for e in ep.events if e.kind == "call")
        assert made == list(range(len(made))) and len(made) >= 2
        requests = [calls_codec.decode_request(i, f) for i, f in client.xrange(keys.calls)]
        assert len([r for r in requests if r.episode_id == eid]) == len(made)
        job = driver_agents.queue(client, keys).fetch_job(driver_agents.job_id(keys.run, eid))
        assert job.return_value()["gateway_reruns"] >= 1
        return ep
    finally:
        stop(agents)
        stop(gateway)
