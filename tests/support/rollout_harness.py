"""Drive a real RolloutWorker in-process, tick by tick, against the test server."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from services.rollout.engine import make_engine
from services.rollout.worker import RolloutWorker
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams import control
from shared.protocol.streams import samples as psamples
from shared.runtime import logs
from shared.runtime.config.keys import Config
from tests.support.procs import spawn, stop, wait_until


def start_tools_worker(redis_url, keys, cfg: Config | None = None):
    """A real rq worker process serving the run's tool queue (tool calls and reward jobs): it runs only the tools
    and the reward ``cfg`` names (the run's config), as a run's tools worker does."""
    cfg = cfg or Config(run=keys.run)
    return spawn(
        "services.rollout.jobs.tools_worker",
        "--run",
        keys.run,
        "--redis-url",
        redis_url,
        "--log-level",
        "warning",
        "--tools",
        cfg.tools,
        "--reward-fn",
        cfg.reward_fn,
    )


@pytest.fixture
def tools_worker(redis_url, keys):
    """Call it with the test's config: ``tools_worker(cfg)`` starts the worker (stopped at the end)."""
    procs = []
    yield lambda cfg: procs.append(start_tools_worker(redis_url, keys, cfg)) or procs[-1]
    for proc in procs:
        stop(proc)


def make_worker(cfg: Config, client, worker_id: str = "w1", engine=None) -> RolloutWorker:
    # the engine a rollout process makes from ``cfg`` (services/rollout/__main__.py), routes included on an MoE model
    engine = engine or make_engine(
        cfg.engine,
        cfg.model_dir,
        max_batch_size=cfg.max_batch_size,
        vllm_args=cfg.vllm_args,
        step_delay_ms=cfg.step_delay_ms,
        routing_replay=cfg.routing_replay,
    )
    tok = AutoTokenizer.from_pretrained(cfg.model_dir)
    worker = RolloutWorker(cfg, client, worker_id, engine, tok, logs.get("rollout-test"))
    worker.start()
    return worker


def tick_until(worker: RolloutWorker, done, timeout: float = 60.0, on_tick=None) -> int:
    deadline = time.monotonic() + timeout
    ticks = 0
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met after {timeout}s ({ticks} ticks)")
        worker.tick(block_ms=5)
        ticks += 1
        if on_tick:
            on_tick(ticks)
    return ticks


def samples(client, keys) -> list[dict]:
    """The samples entries, each as its plain-text fields (through the codec: a malformed one fails the test)."""
    good, bad = psamples.read_all(client, keys.samples)
    assert not bad, bad
    return [psamples.encode(s) for s in good]


def wait_claimable(client, keys, owner: str, heartbeat_ttl: float, timeout: float = 30.0) -> None:
    """Until every prompt group ``owner`` holds has been idle for ``heartbeat_ttl`` (the takeover rule: a group
    pending that long with a dead owner may be claimed)."""

    def idle():
        held = client.xpending_range(keys.prompts, ROLLOUT_GROUP, "-", "+", 10_000, consumername=owner)
        return all(p["time_since_delivered"] >= heartbeat_ttl * 1000 for p in held)

    wait_until(idle, f"{owner}'s groups idle for {heartbeat_ttl}s", timeout)


def worker_info(client, keys, worker: str) -> dict:
    """A rollout worker's heartbeat fields (version, paused, episodes...), {} when it is not alive."""
    from shared.runtime.heartbeat import alive_of

    return alive_of(client, keys, "rollout").get(worker, {})


def snapshot(client, keys, group_ids) -> dict:
    """The episodes of ``group_ids`` whose streams exist so far, folded."""
    log = EpisodeLog(client, keys, "reader")
    reads = log.read_many([f"{gid}-{i}" for gid, n in group_ids for i in range(n)])
    names = [f"{gid}-{i}" for gid, n in group_ids for i in range(n)]
    return {eid: fold(entries) for eid, entries in zip(names, reads) if entries}


def episodes(client, keys, group_ids) -> dict:
    log = EpisodeLog(client, keys, "reader")
    return {eid: fold(log.read(eid)) for gid, n in group_ids for eid in (f"{gid}-{i}" for i in range(n))}


def send(client, keys, cmd: str, sync: str = "s1", **kw) -> None:
    control.send_command(client, keys, control.Command(cmd, sync, **kw))


def acks(client, keys, cmd: str) -> list[dict]:
    out = []
    for _, entry in control.read_after(client, keys, "0-0", count=10_000):
        if isinstance(entry, dict) and entry["cmd"] == cmd:
            out.append(entry)
    return out


# vLLM in tests: float32 (the trainer's dtype; the CPU build would pick bfloat16), a small KV cache,
# blocks of 32 tokens (CPU default 128) so short test prompts fill blocks the prefix cache keeps.
VLLM_TEST_ARGS = '{"dtype": "float32", "kv_cache_memory_bytes": 67108864, "block_size": 32}'


def make_vllm_engine(model_dir: str, max_batch_size: int = 32):
    """One in-process vLLM engine, meant to be shared by a test module (start-up is the cost)."""
    from services.rollout.engine import make_engine

    return make_engine("vllm", model_dir, max_batch_size=max_batch_size, vllm_args=VLLM_TEST_ARGS)


def worker_proc(redis_url, keys, model_dir, worker_id, log=None, max_tokens: int = 48, log_level: str = "info"):
    """A rollout worker subprocess for the takeover drills: flushing every 4 tokens or 20 ms, a 1.5 s heartbeat TTL,
    15 ms per decode step (so a kill lands mid-episode), six groups in flight, no tools."""
    from tests.support.procs import spawn

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
        "--max-tokens",
        str(max_tokens),
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
        log_level,
        log=log,
    )
