"""The rollout worker: one short tick, over and over:

    control (pause / load / resume) -> groups (claim, take over) -> tool and reward jobs -> engine -> flush

All episode state lives in the streams; what this process holds is a cache of it. Resuming after a pause and
taking over a dead worker's groups are the same operation: replay the stream, then continue from prompt +
tokens so far (``episodes/``). Groups are claimed, taken over, published and repacked by ``groups/``, tool calls
and rewards run as rq jobs (``jobs/``), gateway calls are served by ``calls/``, and one agent loop
(``episodes/agent_loop.py``) says what an episode does next. How new versions arrive (the syncer's commands,
rolling waves, or pulled by the worker itself) is one ``weights/sync_modes.py`` object, chosen once at start.
"""

from __future__ import annotations

import time

import redis

from services.rollout.calls.server import CallServer
from services.rollout.engine import Engine, EngineError
from services.rollout.episodes.agent_loop import Agent
from services.rollout.episodes.lifecycle import Episodes
from services.rollout.episodes.prompting import stop_token_ids
from services.rollout.groups.claims import Groups
from services.rollout.groups.repacker import Repacker
from services.rollout.jobs import rewards, tools
from services.rollout.jobs.tool_jobs import ToolJobs
from services.rollout.weights import sync_modes
from services.rollout.weights.local import LocalWeights
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import Keys
from shared.protocol.streams import control, metrics, versions
from shared.runtime.config.keys import Config
from shared.runtime.connection import connect
from shared.runtime.faults import crash_point
from shared.runtime.heartbeat import Heartbeat
from shared.runtime.weights import origins as weight_origins
from shared.runtime.weights.server import WeightServer

# longest blocking read of an idle worker (timers cut it shorter; any event ends it)
IDLE_BLOCK_MS = 1000
# claims are event driven; this only bounds the wait for a slot the trainer gave back
CLAIM_RECHECK_S = 1.0


class RolloutWorker:
    def __init__(
        self,
        cfg: Config,
        client: redis.Redis,
        worker_id: str,
        engine: Engine,
        tokenizer,
        log,
        events: EpisodeLog | None = None,
    ):
        """``events``: where episodes' events go; the run's Redis streams unless given (a benchmark gives an
        in-memory sink to measure what the log costs)."""
        self.cfg, self.client, self.worker_id, self.engine = cfg, client, worker_id, engine
        self.log = log.bind(worker=worker_id)
        self.keys = Keys(cfg.run)
        registry = tools.registry(cfg.tools)
        reward = rewards.load(cfg.reward_fn)
        self.claims = Groups(cfg, client, self.keys, worker_id, self.log)
        # rq: one server
        rq_client = connect(cfg.rq_redis_url, wait=cfg.redis_wait) if cfg.rq_redis_url else client
        self.jobs = ToolJobs(
            rq_client,
            self.keys.tool_queue,
            cfg.run,
            cfg.tools,
            cfg.reward_fn,
            cfg.tool_timeout,
            cfg.reward_timeout,
            wake_on_results=rq_client is client,
        )
        agent = Agent(tokenizer, registry, cfg.max_tool_calls, engine.max_model_len)
        self.episodes = Episodes(
            cfg,
            # the only writer of its plain episodes, which end with its own last event: no end guard to pay for
            events or EpisodeLog(client, self.keys, worker_id, cfg.flush_tokens, cfg.flush_ms, guard_end=False),
            engine,
            tokenizer,
            agent,
            self.jobs,
            self.claims,
            reward,
            stop_token_ids(tokenizer, cfg.model_dir, cfg.stop),
            self.log,
        )
        # gateway calls (agents)
        self.calls = CallServer(cfg, client, worker_id, engine, tokenizer, self.log)
        # long tails
        self.repack = Repacker(cfg, client, self.keys, worker_id, self.episodes, self.claims, self.log)
        self.heartbeat = Heartbeat(client, self.keys, "rollout", worker_id, cfg.heartbeat_ttl)
        # each version's file: the published one, or a download
        self.weights = LocalWeights(cfg, self.log)
        # the token goes only where the run announced a weight server (not to a URL a control entry names)
        self.weights.announced = lambda: weight_origins.announced(client, self.keys, cfg.weights_base_url)
        # serves its verified copies to other workers (relay_port)
        self.relay: WeightServer | None = None
        # how new versions arrive: commanded, rolling, pulled, lockstep
        self.sync = sync_modes.choose(cfg, self)
        self.control_cursor = "$"
        # wake on new prompt groups
        self.prompt_cursors = {self.keys.prompts: "$", self.keys.val_prompts: "$"}
        self.seen = control.Seen()
        self._next_takeover = self._next_claim = 0.0
        # event-driven claiming: see _claim
        self._claim_wanted, self._claimed_with = True, None
        # the wake read went with the step's writes (tick)
        self._wake_sent = False
        self._next_report = time.monotonic() + 5.0
        self.started_at = time.monotonic()
        self.busy_s = 0.0
        self.takeovers = 0

    # --- what tests and probes read
    paused = property(lambda self: self.episodes.paused)
    live = property(lambda self: self.episodes.live)

    @property
    def events(self) -> EpisodeLog:
        return self.episodes.events

    # group id -> GroupRun
    groups = property(lambda self: self.claims.held)

    @property
    def stats(self) -> dict:
        return {
            **self.episodes.stats,
            "groups": self.claims.published,
            "takeovers": self.takeovers,
            **self.weights.stats,
            **self.repack.stats,
            **self.sync.stats,
        }

    def waiting_on_jobs(self) -> bool:
        return self.jobs.waiting()

    # --- lifecycle
    def start(self) -> None:
        self.claims.create_consumer_groups()
        self.control_cursor = control.last_id(self.client, self.keys)
        # from here on, a new entry wakes an idle worker
        for stream in self.prompt_cursors:
            last = self.client.xrevrange(stream, count=1)
            self.prompt_cursors[stream] = last[0][0].decode() if last else "0-0"
        self.calls.start()
        if self.cfg.relay_port:
            # pull: a child asks for a version this worker may still be fetching
            wait_s = self.sync.relay_wait_s
            self.relay = WeightServer(
                self.cfg.rollout_weights_path,
                self.cfg.relay_host,
                max(0, self.cfg.relay_port),
                self.cfg.weights_token,
                resolve=lambda name: self.weights.served(name, wait_s),
                config_keys="relay_host, relay_port",
            ).start()
            self.log.info("relay serving verified weights", url=self.relay.url)
        self.repack.start()
        self.sync.start()
        self.catch_up()
        self.beat(force=True)

    def run(self, should_stop=lambda: False) -> None:
        self.start()
        try:
            while not should_stop():
                self.tick(block_ms=IDLE_BLOCK_MS)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Warm stop: record where every generating episode stopped; leave the prompt groups pending so another
        worker takes them over."""
        self._abort_all("shutdown")
        self.episodes.flush()
        self.episodes.writes.stop()
        self.heartbeat.stop()
        if self.relay is not None:
            self.relay.stop()
        self.report(final=True)
        self.log.info("stopped", **self.stats)

    def tick(self, block_ms: int = 0) -> None:
        """One round: control and wake-ups, claims, jobs, one engine step, flushes. Idle (nothing to generate),
        the read of control blocks up to ``block_ms``, or less when a timer falls due; it wakes at once on a
        command, a new prompt group, a gateway call or a finished rq job: no short polls. Busy, that read is
        non-blocking and rides with the step's writes (``writes.send_step``): one round trip per engine step,
        made while the next step runs; its reply is obeyed after that step."""
        self._read_control(block_ms)
        now = time.monotonic()
        self._take_work(now)
        self._serve_jobs_and_calls()
        if not self.paused and self.engine.has_unfinished():
            self._step_engine()
        else:
            self.episodes.flush(due_only=True)
        self._after_tick(now)

    # --- the tick's phases, in order
    def _read_control(self, block_ms: int) -> None:
        """Control commands and wake-ups; skipped when busy and the last step's write already carried the read."""
        busy = self.engine.has_unfinished() and not self.paused
        if not (busy and self._wake_sent):
            # the reply of a read in flight first: the cursors move in order
            self.episodes.writes.settle()
            self._on_replies()
            self._handle_control(block_ms=0 if busy else self._idle_block_ms(block_ms))
        self._wake_sent = False

    def _take_work(self, now: float) -> None:
        """Claims (and takeovers) under the sync mode's rules; pulled syncs load at this cheap point."""
        if self.paused:
            return
        self.sync.before_claims()
        self._claim(now)
        self.sync.between_steps()

    def _serve_jobs_and_calls(self) -> None:
        """Gateway calls to open or resume, finished rq jobs (tools, rewards) back into their episodes."""
        self.calls.tick(self.paused)
        for outcome in self.jobs.poll():
            self.episodes.on_job(outcome)

    def _step_engine(self) -> None:
        """One engine step; its writes (and the next wake read) travel in one round trip while the next step runs."""
        t0 = time.monotonic()
        # every episode that ends in this step: in the step's one round trip
        with self.episodes.writes.one_flush():
            # chunks are routed by request id (= episode id)
            for chunk in self.engine.step():
                if self.calls.owns(chunk.request_id):
                    self.calls.on_chunk(chunk)
                else:
                    self.episodes.on_chunk(chunk)
        self.busy_s += time.monotonic() - t0
        # the previous step's writes, made while this step ran
        self.episodes.writes.settle(publish_later=True)
        # may pause: that writes everything now
        self._on_replies()
        self._wake_sent = self.engine.has_unfinished() and not self.paused
        self.episodes.writes.send_step(self._wake_read() if self._wake_sent else None)

    def _after_tick(self, now: float) -> None:
        """Long-tail repack (services/rollout/groups/repacker.py), the heartbeat, the periodic report."""
        self.repack.after_tick(self.busy_s)
        self.beat()
        if now >= self._next_report:
            self.report()

    def _claim(self, now: float) -> None:
        """Take over dead workers' groups (every heartbeat_ttl / 2), then claim new ones. Claiming is event
        driven: it is tried when a slot has freed (every episode of a group ended, or it was dropped), when a new
        prompt group or a resume (the gate moves with a sync) woke the worker, and at the latest every
        CLAIM_RECHECK_S (a gate slot given back by the trainer); never throttled, never on every engine step for
        nothing."""
        # a group repacked here: open it before new ones
        if now >= self._next_takeover or self.repack.waiting():
            self._next_takeover = now + self.cfg.heartbeat_ttl / 2
            runs = self.claims.take_over()
            self.takeovers += sum(run.takeover_from is not None for run in runs)
            for run in runs:
                self.repack.opened(run)
            self.episodes.open_groups(runs)
        held = (self.claims.slots_used(), self.claims.published)
        if not (self._claim_wanted or held != self._claimed_with or now >= self._next_claim):
            return
        if self.claims.room() <= 0 and self.claims.val_room() <= 0:
            return
        # rolling: behind the gate and the catch-up failed: retried later
        if not self.sync.may_claim():
            self._claim_wanted, self._claimed_with, self._next_claim = False, held, now + CLAIM_RECHECK_S
            return
        self._claim_wanted = False
        # one pipeline for all of them
        self.episodes.open_groups(self.claims.claim(self.engine.version))
        self._claimed_with, self._next_claim = (self.claims.slots_used(), self.claims.published), now + CLAIM_RECHECK_S

    def _idle_block_ms(self, block_ms: int) -> int:
        """``block_ms``, cut short by the next timer: heartbeat, takeover check, claim recheck, metrics report,
        an event buffer's age flush, a job's deadline."""
        if not block_ms:
            return 0
        due = [
            self.heartbeat.next_due(),
            self._next_takeover,
            self._next_report,
            self.episodes.events.next_due(),
            self.calls.events.next_due(),
            self.jobs.next_deadline(),
            self.sync.next_due(),
        ]
        if self.claims.room() > 0 or self.claims.val_room() > 0:
            due.append(self._next_claim)
        soonest = min((t for t in due if t is not None), default=None)
        if soonest is None:
            return block_ms
        return max(1, min(block_ms, int((soonest - time.monotonic()) * 1000)))

    def beat(self, force: bool = False) -> None:
        relay = {"relay": self.relay.url, "fetch_dir": self.weights.folder_id} if self.relay is not None else {}
        self.heartbeat.beat(
            force=force,
            version=self.engine.version,
            paused=int(self.paused),
            episodes=len(self.live),
            groups=len(self.claims.held),
            role=self.cfg.rollout_role,
            room=self.claims.room(),
            **relay,
        )

    def report(self, final: bool = False) -> None:
        """Throughput and busy/idle time, on the metrics stream every few seconds; ``final`` marks the last
        record of a process (its counters are complete: `streamrl check` reads them)."""
        self._next_report = time.monotonic() + 5.0
        elapsed = time.monotonic() - self.started_at
        metrics.record(
            self.client,
            self.keys,
            "rollout",
            {
                "worker": self.worker_id,
                "time": time.time(),
                "version": self.engine.version,
                "busy_s": self.busy_s,
                "idle_s": max(elapsed - self.busy_s, 0.0),
                "final": final,
                **self.stats,
                **self.calls.stats,
            },
        )

    # --- weights
    def catch_up(self) -> None:
        """Load the newest published version before generating anything."""
        latest = versions.latest(self.client, self.keys)
        if latest and latest.version > self.engine.version:
            self._load(latest.version, latest.path, latest.sha256, latest.url)

    def _load(self, version: int, path: str, sha256: str, url: str = "") -> None:
        # never back: every path that loads checks first; this is the last word
        if version < self.engine.version:
            raise ValueError(f"version {version} is older than the one this worker runs ({self.engine.version})")
        # verified by the fetch before the pause, as a rule; else fetched now, the heartbeat kept meanwhile
        local = self.weights.local(version, path, sha256, url, waiting=lambda: self.beat(force=True))
        was_running = not self.paused
        self._pause()
        try:
            self.engine.load_weights(str(local), version)
        finally:
            if was_running:
                self._resume()
        self.weights.loaded(version)
        self.log.info("weights loaded", version=version, path=str(local))

    def load_pulled(self, v: versions.Version) -> None:
        """sync_mode pull, under the load lease: this worker's own pause, load, resume; the heartbeat carries the
        new version before the lease goes back (the syncer marks the gate complete from the heartbeats)."""
        try:
            self._load(v.version, v.path, v.sha256, v.url)
        except EngineError as exc:
            raise ValueError(str(exc)) from None
        # a newer version: the gate's limit for it
        self._claim_wanted = True
        self.beat(force=True)

    # --- control: fetch / pause / load / resume
    def _wake_streams(self) -> dict:
        # every stream that can give an idle worker work: control, new prompt groups, gateway calls, results of
        # its rq jobs (rq writes one stream per job)
        return {
            self.keys.control: self.control_cursor,
            **self.prompt_cursors,
            **self.calls.wake_streams(),
            **self.jobs.result_streams(),
            **self.repack.wake_streams(),
            **self.sync.wake_streams(),
        }

    def _wake_read(self):
        """The non-blocking read of the wake streams, for the step's pipeline (built on the writer thread, from
        the cursors as they are now: they move only when its reply is obeyed, after the next step)."""
        streams = self._wake_streams()
        return lambda pipe: pipe.xread(streams, count=100)

    def _on_replies(self) -> None:
        replies, self.episodes.writes.replies = self.episodes.writes.replies, []
        for reply in replies:
            self._on_wake(reply)

    def _handle_control(self, block_ms: int) -> None:
        # one read of every wake stream; it returns at once when any has something
        self._on_wake(self.client.xread(self._wake_streams(), count=100, block=block_ms if block_ms else None))

    def _on_wake(self, reply) -> None:
        for stream, entries in reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            # new prompt groups: claim on this tick
            if name in self.prompt_cursors:
                self.prompt_cursors[name] = entries[-1][0].decode()
                self._claim_wanted = True
                continue
            # a long-tail worker: groups handed to it, opened on this tick
            if self.repack.saw(name, entries):
                continue
            # pull: a version announced, a lease freed
            if self.sync.saw(name, entries):
                continue
            if name not in (self.keys.control, self.keys.calls):
                # a job's result: jobs.poll() picks it up on this tick
                continue
            for entry_id, fields in entries:
                if self.calls.saw(stream, entry_id):
                    continue
                self.control_cursor = entry_id.decode()
                try:
                    cmd = control.decode_entry(entry_id, fields)
                except EventError as exc:
                    self.claims.dead_letter(self.keys.control, entry_id, str(exc))
                    continue
                if not isinstance(cmd, control.Command) or not cmd.for_worker(self.worker_id):
                    # an ack, or a command for other workers (a wave, a level of the fetch tree)
                    continue
                # a command read twice is obeyed once
                if self.seen.first(cmd):
                    self._obey(cmd)

    def _obey(self, cmd: control.Command) -> None:
        ok, error = True, ""
        # a sync older than what this worker runs: it caught up meanwhile
        if 0 <= cmd.version < self.engine.version:
            self.log.debug(
                "command of an older sync acknowledged and ignored",
                cmd=cmd.cmd,
                sync=cmd.sync,
                version=cmd.version,
                current=self.engine.version,
            )
            control.send_ack(self.client, self.keys, cmd, self.worker_id, ok, self.engine.version, error)
            return
        # in a thread, while generation goes on; the thread acks once the copy is verified
        if cmd.cmd == "fetch":
            self.weights.prefetch(
                cmd.version,
                cmd.path,
                cmd.sha256,
                cmd.url,
                lambda ok, error: control.send_ack(
                    self.client, self.keys, cmd, self.worker_id, ok, self.engine.version, error
                ),
                relay=cmd.sources.get(self.worker_id, ""),
            )
            return
        if cmd.cmd == "pause":
            self._pause()
        elif cmd.cmd == "load":
            try:
                self._load(cmd.version, cmd.path, cmd.sha256, cmd.url)
            except (OSError, EngineError, ValueError) as exc:
                ok, error = False, str(exc)
                self.log.error(
                    "weights refused; keeping old version",
                    version=cmd.version,
                    current=self.engine.version,
                    error=error,
                )
        elif cmd.cmd == "resume":
            self._resume()
        control.send_ack(self.client, self.keys, cmd, self.worker_id, ok, self.engine.version, error)
        if cmd.cmd == "pause":
            # tests only (shared/runtime/faults.py)
            crash_point("rollout", "paused")
        self.beat(force=True)

    def _pause(self) -> None:
        """Abort generation and make every token durable; tool and reward jobs keep running."""
        if not self.paused:
            self._abort_all("pause")
            self.episodes.flush()
            self.episodes.paused = True

    def _resume(self) -> None:
        # a sync moved the staleness gate
        self._claim_wanted = True
        if self.paused:
            self.episodes.paused = False
            self.episodes.resume_all()
            self.calls.resume()

    def _abort_all(self, reason: str) -> None:
        """Stop generating: every episode and gateway call records where it stopped."""
        chunks = self.engine.abort_all()
        for chunk in chunks:
            if self.calls.owns(chunk.request_id):
                self.calls.on_chunk(chunk)
        self.episodes.abort_all(reason, [c for c in chunks if not self.calls.owns(c.request_id)])
        self.calls.on_abort(reason)
