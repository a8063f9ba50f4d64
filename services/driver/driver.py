"""`streamrl drive`: the process that feeds a run, shows it, and ends it.

It keeps the prompts stream topped up with prompt groups from the task,
prints one progress line every couple of seconds (version, reward, samples/s,
staleness, workers), and exits after ``max_versions`` versions or
``max_minutes`` minutes, which makes honcho stop the other processes.
"""

from __future__ import annotations

import json
import time

from services.driver import agents, tasks  # [gateway hook] agents
from shared.runtime.config import Config
from shared.runtime.connection import connect
from shared.protocol.keys import ROLLOUT_GROUP, Keys
from shared.protocol.prompts import PromptGroup, enqueue
from services.driver.status import alive_services, format_line, snapshot
from shared.runtime.tensorboard import TensorBoard
from services.driver.validation import Validator, split

SERVICES = ("rollout", "trainer", "syncer")
ENDED = "ENDED"  # file in the run's folder once the driver ended the run: `streamrl run` starts the next one afresh


def load_task(cfg: Config) -> list[dict]:
    if cfg.dataset in tasks.BUILTIN:
        return tasks.builtin(cfg.dataset, 4096, seed=cfg.seed)
    return tasks.load_file(cfg.dataset)


def latest_version(client, keys: Keys) -> int:
    last = client.xrevrange(keys.versions, count=1)
    return int(last[0][1][b"version"]) if last else 0


class Driver:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.client = connect(cfg.redis_url, wait=120)
        self.keys = Keys(cfg.run)
        self.rows, held_out = split(load_task(cfg), cfg.val_fraction if cfg.val_every else 0.0)
        self.tensorboard = TensorBoard(cfg, "driver")
        self.validator = Validator(self.client, self.keys, held_out, cfg.val_every, cfg.val_size,
                                   on_result=lambda r: self.tensorboard.scalars("validation", r, r["version"]))
        self.enqueued = int(self.client.get(self.keys.driver_enqueued) or 0)

    def top_up(self, depth: int) -> None:
        """Keep ``depth`` groups waiting beyond what has been delivered."""
        if self.cfg.agent:  # [gateway hook] agent episodes go to the agents workers as rq jobs
            return self.top_up_agents(depth)
        try:
            info = {g["name"].decode(): g for g in self.client.xinfo_groups(self.keys.prompts)}
            lag = info[ROLLOUT_GROUP]["lag"] if ROLLOUT_GROUP in info else self.client.xlen(self.keys.prompts)
        except Exception:  # no stream or group yet
            lag = self.client.xlen(self.keys.prompts) if self.client.exists(self.keys.prompts) else 0
        missing = depth - (lag or 0)
        if missing <= 0:
            return
        groups = []
        for _ in range(missing):
            row = self.rows[self.enqueued % len(self.rows)]
            task = {k: v for k, v in row.items() if k != "prompt"}
            groups.append(PromptGroup(f"q{self.enqueued:07d}", self.cfg.group_size, prompt=row["prompt"], task=task))
            self.enqueued += 1
        enqueue(self.client, self.keys, groups)
        self.client.set(self.keys.driver_enqueued, self.enqueued)

    def top_up_agents(self, depth: int) -> None:  # [gateway hook]
        for _ in range(depth - agents.waiting_groups(self.cfg, self.client, self.keys)):
            row = self.rows[self.enqueued % len(self.rows)]
            agents.enqueue_group(self.cfg, self.client, self.keys, f"q{self.enqueued:07d}", dict(row),
                                 self.cfg.group_size)
            self.enqueued += 1
            self.client.set(self.keys.driver_enqueued, self.enqueued)

    def wait_for_services(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while set(SERVICES) - set(alive_services(self.client, self.keys)):
            if time.monotonic() > deadline:
                missing = set(SERVICES) - set(alive_services(self.client, self.keys))
                raise RuntimeError(f"services not alive after {timeout:.0f}s: {', '.join(sorted(missing))}")
            time.sleep(0.2)

    def progress_line(self, t0: float) -> str:
        return f"[{time.monotonic() - t0:6.0f}s] " + format_line(snapshot(self.client, self.keys))

    def run(self) -> int:
        self.wait_for_services()
        print(f"driver: run {self.cfg.run!r} started; ends after {self.cfg.max_versions or 'unlimited'} versions "
              f"or {self.cfg.max_minutes or 'unlimited'} minutes", flush=True)
        if self.cfg.max_versions and latest_version(self.client, self.keys) >= self.cfg.max_versions:
            print(f"driver: run {self.cfg.run!r} is already at version {self.cfg.max_versions}; start another with "
                  f"--run NAME (or raise --max-versions)", flush=True)
        t0 = time.monotonic()
        depth = 2 * self.cfg.max_groups_in_flight * max(1, alive_services(self.client, self.keys).get("rollout", 1))
        next_print = 0.0
        while True:
            self.top_up(depth)
            now = time.monotonic()
            if now >= next_print:
                print(self.progress_line(t0), flush=True)
                next_print = now + 2.0
            version = latest_version(self.client, self.keys)
            self.validator.maybe_request(version)
            for r in self.validator.poll():
                print(f"driver: validation at version {r['version']}: reward {r['reward_mean']:.3f} sampled, "
                      f"{r['reward_greedy']:.3f} greedy ({r['n']} episodes)", flush=True)
            if self.cfg.max_versions and version >= self.cfg.max_versions:
                print(f"driver: reached version {version}; ending the run", flush=True)
                break
            if self.cfg.max_minutes and now - t0 >= self.cfg.max_minutes * 60:
                print(f"driver: {self.cfg.max_minutes:g} minutes are up at version {version}; ending the run",
                      flush=True)
                break
            time.sleep(0.2)
        self.finish()
        return 0

    def finish(self) -> None:
        from services.driver.plots import write_plots

        for p in write_plots(self.cfg):
            print(f"driver: wrote {p}", flush=True)
        self.cfg.run_path.mkdir(parents=True, exist_ok=True)
        (self.cfg.run_path / ENDED).write_text(json.dumps({"version": latest_version(self.client, self.keys),
                                                           "time": time.time()}))
        # the end-of-run check needs every worker stopped and its final record written: `streamrl run` runs it
        # after honcho has stopped them all; under a bare `honcho start`, run `streamrl check` afterwards
        print(f"driver: run {self.cfg.run!r} ended; `streamrl check --run {self.cfg.run}` verifies it once every "
              f"process has stopped", flush=True)


def drive(cfg: Config) -> int:
    return Driver(cfg).run()
