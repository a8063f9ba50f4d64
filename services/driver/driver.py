"""`streamrl drive`: the process that feeds a run, shows it, and ends it.

It keeps the prompts stream topped up with prompt groups from the task,
prints one progress line every couple of seconds (version, reward, samples/s,
staleness, workers), and exits after ``max_versions`` versions or
``max_minutes`` minutes, which makes honcho stop the other processes.
"""

from __future__ import annotations

import json
import os
import signal
import time

from services.driver import agents, heads, tasks
from services.driver.failfast import CANNOT_TRAIN, FailFast
from services.driver.status import alive_services, format_line, snapshot
from services.driver.validation import Validator, split
from shared.protocol.archive import segments
from shared.protocol.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from shared.protocol.streams import versions
from shared.protocol.streams.prompts import PromptGroup, enqueue, forget, group_id
from shared.runtime import runstate
from shared.runtime.config.keys import Config
from shared.runtime.connection import connect, redact
from shared.runtime.tensorboard import TensorBoard

# when `streamrl keep` (services/ops/launch/keep.py) first started this process, unix seconds
SINCE_ENV = "KEEP_SINCE"

SERVICES = ("rollout", "trainer", "syncer")
# file in the run's folder once the driver ended the run: the next start moves it aside
ENDED = "ENDED"


def load_task(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(training rows, validation rows): the held-out split of ``dataset``, or all of ``eval_dataset``."""
    if cfg.dataset in tasks.BUILTIN:
        rows = tasks.builtin(cfg.dataset, 4096, seed=cfg.seed)
    else:
        rows = tasks.load_rows(cfg.dataset, cfg.dataset_split, cfg.prompt_key, cfg.answer_key)
    if not cfg.eval_dataset:
        return split(rows, cfg.val_fraction if cfg.val_every else 0.0)
    if cfg.eval_dataset in tasks.BUILTIN:
        return rows, tasks.builtin(cfg.eval_dataset, 4096, seed=cfg.seed + 1)
    return rows, tasks.load_rows(cfg.eval_dataset, cfg.eval_split, cfg.prompt_key, cfg.answer_key, "eval_dataset")


def queue_depth(cfg: Config, rollout_workers: int) -> int:
    """Prompt groups kept waiting beyond those delivered: enough for every worker to fill its slots twice, and
    at least what the staleness gate may admit ahead of the trainer, (max_staleness + 2) batches, so no worker
    ever finds the queue empty while the gate is open."""
    batch = cfg.batch_groups * cfg.steps_per_version
    return max(2 * cfg.max_groups_in_flight * max(1, rollout_workers), (cfg.max_staleness + 2) * batch)


def latest_version(client, keys: Keys) -> int:
    return versions.latest_number(client, keys)


class Driver:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.client = connect(cfg.redis_url, wait=cfg.redis_wait)
        self.rq_client = connect(cfg.rq_redis_url, wait=cfg.redis_wait) if cfg.rq_redis_url else self.client
        self.keys = Keys(cfg.run)
        self.meta = runstate.bind(self.client, self.keys, cfg.run_path, cfg.redis_url, config=runstate.recordable(cfg))
        rows, held_out = load_task(cfg)
        self.rows = tasks.RowOrder(rows, cfg.seed, cfg.shuffle)
        self.tensorboard = TensorBoard(cfg, "driver")
        self.validator = Validator(
            self.client,
            self.keys,
            held_out,
            # an agent run's held-out prompts would be rolled out without the agent (its tools, its turns, its
            # reward's reading of them): a figure about another task, so none is made
            0 if cfg.agent else cfg.val_every,
            cfg.val_size,
            on_result=lambda r: self.tensorboard.scalars("validation", r, r["version"]),
            k=cfg.val_k,
            archive=segments.SegmentStore(segments.folder_of(cfg.run_path)),
            run_path=cfg.run_path,
        )
        self.enqueued = int(self.client.get(self.keys.driver_enqueued) or 0)
        # what no reader needs: to files
        self.heads = heads.trimmers(self.client, self.keys, cfg, self.validator)
        # prompt groups of the whole run; 0: no end by epochs
        self.total = cfg.epochs * len(self.rows)

    def epochs_done(self) -> bool:
        """Every group of the last epoch enqueued, rolled out, and read by the trainer (a remainder smaller
        than batch_groups can never fill a step)."""
        if not self.total or self.enqueued < self.total:
            return False
        try:
            groups = {g["name"].decode(): g for g in self.client.xinfo_groups(self.keys.prompts)}
            rollout = groups[ROLLOUT_GROUP]
            trainer = {g["name"].decode(): g for g in self.client.xinfo_groups(self.keys.samples)}[TRAINER_GROUP]
        # no stream or group yet
        except Exception:
            return False
        return (
            rollout["lag"] == 0
            and rollout["pending"] == 0
            and trainer["lag"] == 0
            and trainer["pending"] < self.cfg.batch_groups
        )

    def top_up(self, depth: int) -> None:
        """Keep ``depth`` groups waiting beyond what has been delivered."""
        # agent episodes go to the agents workers as rq jobs
        if self.cfg.agent:
            return self.top_up_agents(depth)
        try:
            info = {g["name"].decode(): g for g in self.client.xinfo_groups(self.keys.prompts)}
            lag = info[ROLLOUT_GROUP]["lag"] if ROLLOUT_GROUP in info else self.client.xlen(self.keys.prompts)
        # no stream or group yet
        except Exception:
            lag = self.client.xlen(self.keys.prompts) if self.client.exists(self.keys.prompts) else 0
        missing = min(depth - (lag or 0), self.total - self.enqueued if self.total else depth)
        if missing <= 0:
            return
        groups = []
        for _ in range(missing):
            # position in the epoch's (seeded) order
            epoch, position = divmod(self.enqueued, len(self.rows))
            row = self.rows.row(self.enqueued)
            task = {k: v for k, v in row.items() if k != "prompt"}
            groups.append(PromptGroup(group_id(epoch, position), self.cfg.group_size, prompt=row["prompt"], task=task))
            self.enqueued += 1
        enqueue(self.client, self.keys, groups)
        self.count_enqueued([g.group_id for g in groups])

    def count_enqueued(self, group_ids: list[str]) -> None:
        """Record the counter past ``group_ids``, then drop their enqueue markers (in this order, one round trip)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.driver_enqueued, self.enqueued)
        forget(pipe, self.keys, group_ids)
        pipe.execute()

    def top_up_agents(self, depth: int) -> None:
        """Agent runs: each group's episodes as rq jobs (services/driver/agents.py), same rows and ids."""
        for _ in range(depth - agents.waiting_groups(self.cfg, self.rq_client, self.keys)):
            if self.total and self.enqueued >= self.total:
                return
            epoch, position = divmod(self.enqueued, len(self.rows))
            if (
                agents.enqueue_group(
                    self.cfg,
                    self.client,
                    self.keys,
                    group_id(epoch, position),
                    dict(self.rows.row(self.enqueued)),
                    self.cfg.group_size,
                    self.rq_client,
                )
                is None
            ):
                # the staleness gate is closed until the next sync
                return
            self.enqueued += 1
            # agent groups keep their markers (7 days)
            self.client.set(self.keys.driver_enqueued, self.enqueued)

    def wait_for_services(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while set(SERVICES) - set(alive_services(self.client, self.keys)):
            if time.monotonic() > deadline:
                missing = set(SERVICES) - set(alive_services(self.client, self.keys))
                raise RuntimeError(f"services not alive after {timeout:.0f}s: {', '.join(sorted(missing))}")
            time.sleep(0.2)

    def progress_line(self, t0: float) -> str:
        return f"[{time.monotonic() - t0:6.0f}s] " + format_line(snapshot(self.client, self.keys, self.cfg.run_path))

    def run(self) -> int:
        # an ended run is never continued (docs/operations.md)
        if ended := runstate.ended(self.meta):
            print(
                f"driver: run {self.cfg.run!r} ended {ended}; nothing to continue on {redact(self.cfg.redis_url)}; "
                f"start another with --run NAME",
                flush=True,
            )
            return 0
        self.wait_for_services()
        print(
            f"driver: run {self.cfg.run!r} started; ends after {self.cfg.max_versions or 'unlimited'} versions "
            f"or {self.cfg.max_minutes or 'unlimited'} minutes",
            flush=True,
        )
        if self.cfg.agent and self.cfg.val_every:
            print(
                "driver: no validation rounds in an agent run (they would run the held-out prompts without the agent); "
                "the reward on the progress line is the agent's own",
                flush=True,
            )
        if self.cfg.max_versions and latest_version(self.client, self.keys) >= self.cfg.max_versions:
            print(
                f"driver: run {self.cfg.run!r} is already at version {self.cfg.max_versions}; start another with "
                f"--run NAME",
                flush=True,
            )
        # the clock of max_minutes runs from when this driver was first started in this session: a driver that
        # `streamrl keep` restarted after a crash goes on with it (a continued run, started again, gets a new one)
        t0 = time.monotonic() - max(0.0, time.time() - float(os.environ.get(SINCE_ENV, time.time())))
        depth = queue_depth(self.cfg, alive_services(self.client, self.keys).get("rollout", 1))
        next_print = 0.0
        fail_fast = FailFast(
            self.client, self.keys, self.cfg.fail_fast_groups if self.cfg.agent else 0, self.cfg.group_size
        )
        wake = {self.keys.samples: "$", self.keys.val_samples: "$", self.keys.versions: "$"}
        for stream in wake:
            last = self.client.xrevrange(stream, count=1)
            wake[stream] = last[0][0].decode() if last else "0-0"
        while True:
            self.top_up(depth)
            for head in self.heads:
                head.maybe_trim()
            now = time.monotonic()
            if now >= next_print:
                print(self.progress_line(t0), flush=True)
                next_print = now + 2.0
            version = latest_version(self.client, self.keys)
            if why := fail_fast.poll(version):
                print(self.progress_line(t0), flush=True)
                print(why, flush=True)
                return CANNOT_TRAIN
            self.validator.maybe_request(version)
            for r in self.validator.poll():
                k = self.cfg.val_k
                print(
                    f"driver: validation at version {r['version']}: reward {r['reward_mean']:.3f} sampled, "
                    f"{r['reward_greedy']:.3f} greedy, pass@{k} {r[f'pass@{k}']:.3f}, mean@{k} {r[f'mean@{k}']:.3f} "
                    f"({r['n']} episodes)",
                    flush=True,
                )
            if self.epochs_done():
                print(
                    f"driver: {self.cfg.epochs} epoch(s) of {len(self.rows)} rows trained at version {version}; "
                    f"ending the run",
                    flush=True,
                )
                break
            asked = runstate.end_requested(self.client, self.keys)
            if asked:
                print(f"driver: asked to end the run ({asked}) at version {version}; ending the run", flush=True)
                break
            if self.cfg.max_versions and version >= self.cfg.max_versions:
                print(f"driver: reached version {version}; ending the run", flush=True)
                break
            if self.cfg.max_minutes and now - t0 >= self.cfg.max_minutes * 60:
                print(
                    f"driver: {self.cfg.max_minutes:g} minutes are up at version {version}; ending the run", flush=True
                )
                break
            # wake on what changes the picture: a group rolled out (a worker's slot freed: top up now), a
            # version published, a validation result; else when the next progress line is due
            for stream, entries in (
                self.client.xread(wake, block=max(1, int((next_print - time.monotonic()) * 1000))) or []
            ):
                wake[stream.decode() if isinstance(stream, bytes) else stream] = entries[-1][0].decode()
        self.finish()
        return 0

    def finish(self) -> None:
        from services.driver.plots import write_plots

        for p in write_plots(self.cfg):
            print(f"driver: wrote {p}", flush=True)
        self.cfg.run_path.mkdir(parents=True, exist_ok=True)
        version = latest_version(self.client, self.keys)
        runstate.mark_ended(self.client, self.keys, version)
        (self.cfg.run_path / ENDED).write_text(json.dumps({"version": version, "time": time.time()}))
        # the end-of-run check needs every worker stopped and its final record written: `streamrl run` runs it
        # after honcho has stopped them all; under a bare `honcho start`, run `streamrl check` afterwards
        print(
            f"driver: run {self.cfg.run!r} ended; `streamrl check --run {self.cfg.run}` verifies it once every "
            f"process has stopped",
            flush=True,
        )


def _stopped(signum, frame) -> None:
    """SIGTERM (honcho stopping every process, an operator): the driver holds nothing to flush (what it enqueued
    is counted in Redis), so it exits 0; the run is not ended and continues when started again."""
    raise SystemExit(0)


def drive(cfg: Config) -> int:
    signal.signal(signal.SIGTERM, _stopped)
    return Driver(cfg).run()
