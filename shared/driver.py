"""`streamrl drive`: the process that steers a run and ends it.

For now it waits until every service is alive, writes one demonstration
episode through the episode log, prints its replay and the run's streams,
and exits (which makes honcho stop the other processes)."""

from __future__ import annotations

import time

from shared.config import Config
from shared.connection import connect
from shared.episode_log import EpisodeLog
from shared.keys import Keys
from shared.views import format_streams, format_timeline, run_streams

SERVICES = ("rollout", "trainer", "syncer")


def alive_services(client, keys: Keys) -> set[str]:
    return {k.decode().split(":")[3] for k in client.scan_iter(match=f"{keys.base}alive:*")}


def drive(cfg: Config, timeout: float = 120.0) -> int:
    client = connect(cfg.redis_url, wait=60)
    keys = Keys(cfg.run)
    deadline = time.monotonic() + timeout
    while (missing := set(SERVICES) - alive_services(client, keys)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if missing:
        print(f"driver: services not alive after {timeout:.0f}s: {', '.join(sorted(missing))}")
        return 1
    print(f"driver: services alive: {', '.join(SERVICES)}")
    log = EpisodeLog(client, keys, "driver", cfg.flush_tokens, cfg.flush_ms)
    log.open("demo-0")
    log.append("demo-0", "started", {"episode_id": "demo-0", "group_id": "demo", "index": 0,
                                     "prompt_ids": [20, 21, 22], "sampling": {"max_tokens": 8}, "task": {}}, 0)
    log.append_tokens("demo-0", [30, 31, 32], [-0.5, -0.25, -1.0], 0)
    log.append("demo-0", "finished", {"reason": "stop", "reward": 1.0}, 0)
    log.flush_or_raise()
    print(format_timeline(log.replay("demo-0")))
    print(format_streams(run_streams(client, keys), keys))
    return 0
