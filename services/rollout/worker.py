"""The rollout worker loop: claim prompt groups, drive their episodes through
the engine and the tools, write every event to the episode streams, and obey
pause / load / resume from the control stream.

All episode state lives in the streams; what this process holds is a cache
of it. Resuming after a pause and taking over a dead worker's groups are the
same operation: replay the stream, then continue from prompt + tokens so far.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from services.rollout import rewards, tools
from services.rollout.calls import CallServer  # [gateway hook]
from services.rollout.engine import Chunk, Engine, EngineError, SamplingParams
from services.rollout.episode import LiveEpisode, State, episode_seed
from shared.protocol import control
from shared.runtime.checksum import sha256_file
from shared.runtime.config import Config
from shared.protocol.episode_log import EpisodeLog, Fenced
from shared.protocol.events import EventError
from shared.protocol.fold import fold
from shared.protocol.keys import ROLLOUT_GROUP as GROUP, Keys
from shared.protocol.prompts import PromptGroup, decode_group


_PUBLISH = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', 604800) then
  redis.call('XADD', KEYS[2], '*', 'group_id', ARGV[1], 'episodes', ARGV[2], 'worker', ARGV[3], 'n', ARGV[4])
end
return redis.call('XACK', KEYS[3], ARGV[5], ARGV[6])
"""


@dataclass
class GroupRun:
    group: PromptGroup
    episodes: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    source: str = ""  # the prompts stream the group came from (training or validation)


class RolloutWorker:
    def __init__(self, cfg: Config, client: redis.Redis, worker_id: str, engine: Engine, tokenizer, log):
        self.cfg, self.client, self.worker_id, self.engine, self.tok = cfg, client, worker_id, engine, tokenizer
        self.log = log.bind(worker=worker_id)
        self.keys = Keys(cfg.run)
        self.events = EpisodeLog(client, self.keys, worker_id, cfg.flush_tokens, cfg.flush_ms)
        self.tool_queue = Queue(self.keys.tool_queue, connection=client, serializer=JSONSerializer)
        self.tool_names = {t.strip() for t in cfg.tools.split(",") if t.strip()}
        self.reward_fn = rewards.load(cfg.reward_fn)
        self._publish = client.register_script(_PUBLISH)
        self.live: dict[str, LiveEpisode] = {}
        self.groups: dict[str, GroupRun] = {}
        self.paused = False
        self.control_cursor = "$"
        self.stop_token_ids = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
        self._next_heartbeat = self._next_takeover = 0.0
        self._missing_since: dict[str, float] = {}  # worker -> when its heartbeat key was first seen missing
        self._gated = False
        self._next_claim = 0.0
        self._next_report = time.monotonic() + 5.0
        self.started_at = time.monotonic()
        self.busy_s = 0.0
        self.stats = {"tokens": 0, "episodes": 0, "groups": 0, "takeovers": 0, "resumed": 0}
        self.calls = CallServer(cfg, client, worker_id, engine, tokenizer, self.log)  # [gateway hook]

    # --- setup
    def start(self) -> None:
        for stream in (self.keys.val_prompts, self.keys.prompts):
            try:
                self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        last = self.client.xrevrange(self.keys.control, count=1)
        self.control_cursor = last[0][0].decode() if last else "0-0"
        self.calls.start()  # [gateway hook]
        self._catch_up_version()
        self.heartbeat()

    def _catch_up_version(self) -> None:
        """Load the newest published version before generating anything."""
        latest = self.client.xrevrange(self.keys.versions, count=1)
        if latest:
            f = {k.decode(): v.decode() for k, v in latest[0][1].items()}
            if int(f["version"]) > self.engine.version:
                self._load(int(f["version"]), f["path"], f.get("sha256", ""))

    # --- the loop
    def run(self, should_stop=lambda: False) -> None:
        self.start()
        try:
            while not should_stop():
                self.tick(block_ms=50)
        finally:
            self.shutdown()

    def tick(self, block_ms: int = 0) -> None:
        now = time.monotonic()
        busy = self.engine.has_unfinished() and not self.paused
        self._handle_control(block_ms=0 if busy or self._waiting_on_tools() else block_ms)
        if now >= self._next_takeover and not self.paused:
            self._next_takeover = now + self.cfg.heartbeat_ttl / 2
            self._take_over_dead_workers()
        if not self.paused and now >= self._next_claim:
            self._claim_groups()
        self.calls.tick(self.paused)  # [gateway hook]
        self._poll_tools()
        if not self.paused and self.engine.has_unfinished():
            t0 = time.monotonic()
            for chunk in self.engine.step():
                self._on_chunk(chunk)
            if self.cfg.step_delay_ms:
                time.sleep(self.cfg.step_delay_ms / 1000)
            self.busy_s += time.monotonic() - t0
        self._check_flush(self.events.maybe_flush())
        if now >= self._next_heartbeat:
            self.heartbeat()
        if now >= self._next_report:
            self.report()

    def report(self, final: bool = False) -> None:
        """Throughput and busy/idle time, on the metrics stream every few seconds; ``final``
        marks the last record of a process (its counters are complete: `streamrl check` reads them)."""
        self._next_report = time.monotonic() + 5.0
        elapsed = time.monotonic() - self.started_at
        self.client.xadd(self.keys.metrics, {"kind": "rollout", "json": json.dumps({
            "worker": self.worker_id, "time": time.time(), "version": self.engine.version, "busy_s": self.busy_s,
            "idle_s": max(elapsed - self.busy_s, 0.0), "final": final, **self.stats, **self.calls.stats})},
            maxlen=100_000, approximate=True)

    def heartbeat(self) -> None:
        self._next_heartbeat = time.monotonic() + min(1.0, self.cfg.heartbeat_ttl / 3)
        key = self.keys.alive("rollout", self.worker_id)
        pipe = self.client.pipeline()
        pipe.hset(key, mapping={"time": time.time(), "version": self.engine.version, "paused": int(self.paused),
                                "episodes": len(self.live), "groups": len(self.groups)})
        pipe.pexpire(key, int(self.cfg.heartbeat_ttl * 1000))
        pipe.execute()

    def shutdown(self) -> None:
        """Warm stop: record where every generating episode stopped; leave the
        prompt groups pending so another worker takes them over."""
        self._abort_generation("shutdown")
        self._check_flush(self.events.flush())
        self.client.delete(self.keys.alive("rollout", self.worker_id))
        self.report(final=True)
        self.log.info("stopped", **self.stats)

    # --- prompt groups
    def _claim_groups(self) -> None:
        # validation groups first: they are served with priority and pass no staleness gate (never trained)
        room = self.cfg.max_groups_in_flight - len(self.groups)
        if room > 0:
            reply = self.client.xreadgroup(GROUP, self.worker_id, {self.keys.val_prompts: ">"}, count=room)
            for entry_id, fields in (e for _, es in reply or [] for e in es):
                self._open_group(entry_id, fields, source=self.keys.val_prompts)
        free = self._reserve(self.cfg.max_groups_in_flight - len(self.groups))
        if free <= 0:
            self._next_claim = time.monotonic() + 0.05
            return
        reply = self.client.xreadgroup(GROUP, self.worker_id, {self.keys.prompts: ">"}, count=free)
        entries = [e for _, es in reply or [] for e in es]
        if not entries:  # nothing waiting: look again a little later, not every decode step
            self._next_claim = time.monotonic() + 0.05
        if len(entries) < free and self._gated:
            self.client.decrby(self.keys.gate_started, free - len(entries))
        for entry_id, fields in entries:
            if self._open_group(entry_id, fields) is False and self._gated:
                self.client.decr(self.keys.gate_started)  # a dead-lettered entry starts no group: its slot back

    def _reserve(self, want: int) -> int:
        """Starts the staleness gate allows now (all of them when no syncer set a gate)."""
        self._gated = False
        if want <= 0:
            return 0
        limit, gate_version = self.client.hmget(self.keys.gate, "limit", "version")
        if limit is None:
            return 0 if self.cfg.mode == "sync" else want  # sync: nothing starts before the syncer opens the gate
        if self.cfg.mode == "sync" and int(gate_version) != self.engine.version:
            # sync: a group starts only under the very version the gate admits it for
            if int(gate_version) > self.engine.version and not self.paused:
                self._catch_up_version()  # this worker missed a sync
            return 0
        self._gated = True
        started = self.client.incrby(self.keys.gate_started, want)
        over = min(want, started - int(limit))
        if over > 0:
            self.client.decrby(self.keys.gate_started, over)
        return want - max(over, 0)

    def _open_group(self, entry_id, fields, takeover_from: str | None = None, source: str | None = None) -> None:
        source = source or self.keys.prompts
        try:
            group = decode_group(entry_id, fields)
        except EventError as exc:
            self._dead_letter(source, entry_id, str(exc))
            self.client.xack(source, GROUP, entry_id)
            return False
        run = GroupRun(group, group.episode_ids(), source=source)
        self.groups[group.group_id] = run
        self.log.info("group claimed", group=group.group_id, n=group.n, takeover_from=takeover_from)
        # one round trip reads every episode stream, one more makes every new episode's start durable
        fresh = []
        for index, (episode_id, entries) in enumerate(zip(run.episodes, self.events.read_many(run.episodes))):
            if entries:
                self._resume_from_stream(run, episode_id, entries, takeover_from)
            elif (live := self._open_episode(run, index, episode_id)) is not None:
                fresh.append(live)
        if fresh:
            self._check_flush(self.events.flush([live.episode_id for live in fresh]))
        for live in fresh:
            if live.episode_id in self.live:
                self._generate(live)
        self._maybe_publish(run)

    def _params(self, group: PromptGroup, index: int) -> SamplingParams:
        o = group.sampling
        return SamplingParams(temperature=float(o.get("temperature", self.cfg.temperature)),
                              top_p=float(o.get("top_p", self.cfg.top_p)), top_k=int(o.get("top_k", self.cfg.top_k)),
                              max_tokens=int(o.get("max_tokens", self.cfg.max_tokens)),
                              stop_token_ids=self.stop_token_ids,
                              seed=int(o.get("seed", episode_seed(self.cfg.seed, group.group_id, index))))

    def _open_episode(self, run: GroupRun, index: int, episode_id: str) -> LiveEpisode | None:
        """Start a new episode (its stream is empty): the ``started`` event, buffered; the caller flushes it and
        starts generation. None when the episode failed at once (prompt too long)."""
        group = run.group
        prompt_ids = group.prompt_ids if group.prompt_ids is not None else \
            self.tok.encode(group.prompt, add_special_tokens=False)
        params = self._params(group, index)
        live = LiveEpisode(episode_id, group.group_id, index, list(prompt_ids), params, group.task)
        self.live[episode_id] = live
        self.events.open(episode_id)
        self.events.append(episode_id, "started", {
            "episode_id": episode_id, "group_id": group.group_id, "index": index, "prompt_ids": live.prompt_ids,
            "sampling": params.to_dict(), "task": group.task}, self.engine.version)
        if len(prompt_ids) + 1 > self.engine.max_model_len:
            self._fail(live, f"prompt of {len(prompt_ids)} tokens does not fit the model's context of "
                             f"{self.engine.max_model_len} tokens (prompt group entry {group.entry_id})", "prompt")
            return None
        return live

    def _resume_from_stream(self, run: GroupRun, episode_id: str, entries, takeover_from) -> None:
        try:
            ep = fold(entries)
        except EventError as exc:
            self._dead_letter(self.keys.episode(episode_id), exc.entry_id, str(exc))
            self.log.error("episode stream unreadable; episode dropped", episode=episode_id, error=str(exc))
            run.done.add(episode_id)
            return
        if ep.done:
            run.done.add(episode_id)
            return
        live = LiveEpisode.from_fold(ep, SamplingParams.from_dict({**ep.sampling,
                                                                   "stop_token_ids": self.stop_token_ids}))
        self.live[episode_id] = live
        self.events.open(episode_id, ep.last_seq + 1)
        takeover = takeover_from if ep.last_worker != self.worker_id else None
        self.events.append(episode_id, "resumed", {"num_tokens": len(ep.tokens),
                                                   **({"takeover_from": ep.last_worker} if takeover else {})},
                           self.engine.version)
        self.stats["resumed"] += 1
        self.log.info("episode resumed from stream", episode=episode_id, tokens=len(ep.tokens),
                      takeover_from=ep.last_worker if takeover else None)
        pending = ep.pending_tool_calls
        if pending:
            call = pending[-1]
            self._start_tool(live, call["call_id"], call["name"], call["args"], already_recorded=True)
        else:
            self._check_flush(self.events.flush([episode_id]))
            if episode_id in self.live:
                self._generate(live)

    # --- generation
    def _generate(self, live: LiveEpisode) -> None:
        if self.paused:
            live.state = State.PAUSED
            return
        if live.remaining <= 0:
            return self._finish(live, "length")
        if len(live.context_ids) >= self.engine.max_model_len:
            return self._finish(live, "context")
        try:
            self.engine.add_request(live.episode_id, live.context_ids, live.params, live.remaining,
                                    start_index=len(live.tokens))
        except EngineError as exc:
            return self._fail(live, str(exc), "engine")
        live.state = State.GENERATING

    def _on_chunk(self, chunk: Chunk) -> None:
        if self.calls.owns(chunk.request_id):  # [gateway hook]
            return self.calls.on_chunk(chunk)
        live = self.live.get(chunk.request_id)
        if live is None:
            return
        self._record_tokens(live, chunk)
        if chunk.finish_reason == "abort":
            return
        call = self._detect_call(live) if self.tool_names else None
        if call is not None:
            if chunk.finish_reason is None:
                rest = self.engine.abort(live.episode_id)
                if rest is not None:
                    self._record_tokens(live, rest)
            return self._on_call(live, call)
        if chunk.finish_reason is not None:
            reason = chunk.finish_reason
            if reason == "length" and live.remaining > 0:
                reason = "context"
            self._finish(live, reason)

    def _record_tokens(self, live: LiveEpisode, chunk: Chunk) -> None:
        if chunk.token_ids:
            self.events.append_tokens(live.episode_id, chunk.token_ids, chunk.logprobs, chunk.version)
            live.tokens += chunk.token_ids
            live.num_generated += len(chunk.token_ids)
            self.stats["tokens"] += len(chunk.token_ids)

    def _detect_call(self, live: LiveEpisode):
        tail = self.tok.decode(live.tokens[max(live.turn_start, len(live.tokens) - 16):])
        if tools.CALL_CLOSE not in tail:
            return None
        turn = self.tok.decode(live.tokens[live.turn_start:])
        try:
            return tools.parse_call(turn) or ToolCallProblem("malformed tool call: '</call>' without '<call>'")
        except tools.ToolError as exc:
            return ToolCallProblem(str(exc))

    def _abort_generation(self, reason: str) -> None:
        for chunk in self.engine.abort_all():
            if self.calls.owns(chunk.request_id):  # [gateway hook]
                self.calls.on_chunk(chunk)
                continue
            live = self.live.get(chunk.request_id)
            if live is not None:
                self._record_tokens(live, chunk)
        for live in self.live.values():
            if live.state in (State.GENERATING, State.PAUSED):
                live.state = State.PAUSED
                self.events.append(live.episode_id, "aborted", {"reason": reason, "num_tokens": len(live.tokens)},
                                   self.engine.version)
        self.calls.on_abort(reason)  # [gateway hook]

    # --- tools
    def _on_call(self, live: LiveEpisode, call) -> None:
        if live.num_tool_calls >= self.cfg.max_tool_calls:
            return self._finish(live, "tool_limit")
        live.num_tool_calls += 1
        call_id = f"c{live.num_tool_calls}"
        if isinstance(call, ToolCallProblem):
            name, args = "?", ""
        else:
            name, args = call
        self.events.append(live.episode_id, "tool_call", {"call_id": call_id, "name": name, "args": args},
                           self.engine.version)
        if isinstance(call, ToolCallProblem):
            return self._tool_result(live, call_id, False, call.message)
        if name not in self.tool_names:
            return self._tool_result(live, call_id, False,
                                     f"unknown tool {name!r}; available: {', '.join(sorted(self.tool_names))}")
        self._start_tool(live, call_id, name, args)

    def _job_id(self, episode_id: str, call_id: str) -> str:
        return re.sub(r"[^A-Za-z0-9_-]", "_", f"{self.cfg.run}-{episode_id}-{call_id}")

    def _start_tool(self, live: LiveEpisode, call_id: str, name: str, args: str, already_recorded=False) -> None:
        # the call is durable before the job exists, so a crash can always re-attach to it
        self._check_flush(self.events.flush([live.episode_id]))
        if live.episode_id not in self.live:
            return
        job_id = self._job_id(live.episode_id, call_id)
        if not already_recorded or Job.exists(job_id, connection=self.client) is False:
            self.tool_queue.enqueue_call(tools.run_tool, args=(name, args), job_id=job_id,
                                         timeout=max(1, int(self.cfg.tool_timeout)), result_ttl=3600,
                                         failure_ttl=3600)
        live.state, live.job_id, live.call_id = State.TOOL, job_id, call_id
        # a job no rq worker picks up is not waited on forever
        live.job_deadline = time.monotonic() + 3 * self.cfg.tool_timeout + 5

    def _waiting_on_tools(self) -> bool:
        return any(l.state is State.TOOL for l in self.live.values())

    def _poll_tools(self) -> None:
        waiting = [l for l in self.live.values() if l.state is State.TOOL]
        if not waiting:
            return
        jobs = Job.fetch_many([l.job_id for l in waiting], connection=self.client, serializer=JSONSerializer)
        for live, job in zip(waiting, jobs):
            if self.live.get(live.episode_id) is not live:
                continue  # dropped with its group (fenced) by an earlier result in this loop
            status = job.get_status(refresh=False) if job is not None else None
            if status == JobStatus.FINISHED:
                self._tool_result(live, live.call_id, True, str(job.return_value()))
            elif status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                result = job.latest_result()
                exc = (result.exc_string or "").strip().splitlines() if result else []
                message = exc[-1] if exc else f"tool job {status.value}"
                if "JobTimeoutException" in message:
                    message = f"tool timed out after {self.cfg.tool_timeout:g}s"
                self._tool_result(live, live.call_id, False, message)
            elif job is None or time.monotonic() > live.job_deadline:
                if job is not None:
                    job.cancel()
                self._tool_result(live, live.call_id, False,
                                  f"tool did not complete within {3 * self.cfg.tool_timeout + 5:g}s")

    def _tool_result(self, live: LiveEpisode, call_id: str, ok: bool, output: str) -> None:
        ids = self.tok.encode(tools.format_result(ok, output[:tools.MAX_OUTPUT_CHARS]), add_special_tokens=False)
        self.events.append(live.episode_id, "tool_result", {"call_id": call_id, "ok": ok, "output": output,
                                                            "ids": ids}, self.engine.version)
        self._check_flush(self.events.flush([live.episode_id]))
        if live.episode_id not in self.live:
            return
        live.tokens += ids
        live.turn_start = len(live.tokens)
        live.job_id = live.call_id = None
        live.state = State.PAUSED
        self._generate(live)

    # --- endings
    def _finish(self, live: LiveEpisode, reason: str) -> None:
        text = self.tok.decode(live.tokens, skip_special_tokens=True)
        try:
            reward, details = rewards.score(self.reward_fn, text, live.task)
        except Exception as exc:  # a user's reward function can raise anything
            return self._fail(live, f"reward function {self.cfg.reward_fn} raised {exc.__class__.__name__}: {exc}",
                              "reward")
        self.events.append(live.episode_id, "finished", {"reason": reason, "reward": reward, "details": details},
                           self.engine.version)
        self._close(live)

    def _fail(self, live: LiveEpisode, error: str, where: str) -> None:
        self.log.warning("episode failed", episode=live.episode_id, error=error, where=where)
        self.events.append(live.episode_id, "failed", {"error": error, "where": where}, self.engine.version)
        self._close(live)

    def _close(self, live: LiveEpisode) -> None:
        live.state = State.DONE
        self._check_flush(self.events.flush([live.episode_id]))
        if live.episode_id not in self.live:
            return
        self.events.close(live.episode_id)
        del self.live[live.episode_id]
        self.stats["episodes"] += 1
        run = self.groups.get(live.group_id)
        if run is not None:
            run.done.add(live.episode_id)
            self._maybe_publish(run)

    def _maybe_publish(self, run: GroupRun) -> None:
        if len(run.done) < len(run.episodes) or self.groups.get(run.group.group_id) is not run:
            return
        g = run.group
        samples = self.keys.val_samples if run.source == self.keys.val_prompts else self.keys.samples
        self._publish(keys=[self.keys.sampled(g.group_id), samples, run.source],
                      args=[g.group_id, ",".join(run.episodes), self.worker_id, g.n, GROUP, g.entry_id])
        del self.groups[g.group_id]
        self.stats["groups"] += 1
        self.log.info("group finished", group=g.group_id)

    def _check_flush(self, errors: dict) -> None:
        for episode_id, exc in errors.items():
            if isinstance(exc, Fenced):
                self._drop_group_of(episode_id, str(exc))
            else:
                raise exc

    def _drop_group_of(self, episode_id: str, why: str) -> None:
        """Another worker owns this episode now: stop touching its whole group."""
        live = self.live.get(episode_id)
        group_id = live.group_id if live else episode_id.rsplit("-", 1)[0]
        self.log.warning("lost ownership; dropping group", group=group_id, reason=why)
        for eid in list(self.groups.get(group_id, GroupRun(PromptGroup(group_id, 0))).episodes):
            if eid in self.live:
                self.engine.abort(eid)
                self.events.close(eid)
                del self.live[eid]
        self.groups.pop(group_id, None)

    def _dead_letter(self, stream: str, entry_id, reason: str) -> None:
        entry_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        self.log.error("bad input sent to dead letters", stream=stream, entry=entry_id, reason=reason)
        self.client.xadd(self.keys.dead_letters, {"stream": stream, "entry": entry_id, "reason": reason,
                                                  "by": self.worker_id})

    # --- crash takeover
    def _take_over_dead_workers(self) -> None:
        free = self.cfg.max_groups_in_flight - len(self.groups)
        if free <= 0:
            return
        min_idle = int(self.cfg.heartbeat_ttl * 1000)
        for stream in (self.keys.val_prompts, self.keys.prompts):
            pending = self.client.xpending_range(stream, GROUP, min="-", max="+", count=100)
            # pending under this worker but held by nobody: a group dropped after its stream refused an append
            # because a Redis restart lost the stream's last second, or one published and then forgotten by
            # Redis (its samples entry and acknowledgement lost together). Re-open it from its streams.
            held = {run.group.entry_id for run in self.groups.values()}
            orphans = [p["message_id"] for p in pending
                       if p["consumer"].decode() == self.worker_id and p["message_id"].decode() not in held]
            if orphans:
                for entry_id, fields in self.client.xclaim(stream, GROUP, self.worker_id, 0, orphans[:free]):
                    if fields:
                        self.log.warning("re-opening a group this worker no longer held", entry=entry_id.decode())
                        self._open_group(entry_id, fields, source=stream)
                        free -= 1
                if free <= 0:
                    return
            dead: dict[str, list] = {}
            for p in pending:
                owner = p["consumer"].decode()
                if owner != self.worker_id and p["time_since_delivered"] >= min_idle:
                    dead.setdefault(owner, []).append(p["message_id"])
            for owner, ids in dead.items():
                if self.client.exists(self.keys.alive("rollout", owner)):
                    self._missing_since.pop(owner, None)
                    continue
                # dead once its heartbeat has been missing for a whole heartbeat_ttl: after a Redis restart every
                # heartbeat key lapses at once, and live workers write theirs again within heartbeat_ttl / 3
                first_missing = self._missing_since.setdefault(owner, time.monotonic())
                if time.monotonic() - first_missing < self.cfg.heartbeat_ttl:
                    continue
                claimed = self.client.xclaim(stream, GROUP, self.worker_id, min_idle, ids[:free])
                for entry_id, fields in claimed:
                    if fields:
                        self.stats["takeovers"] += 1
                        self._open_group(entry_id, fields, takeover_from=owner, source=stream)
                free -= len(claimed)
                if free <= 0:
                    return

    # --- control: pause / load / resume
    def _handle_control(self, block_ms: int) -> None:
        reply = self.client.xread({self.keys.control: self.control_cursor, **self.calls.wake_streams()},
                                  count=100, block=block_ms if block_ms else None)  # [gateway hook] wake_streams
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                if self.calls.saw(stream, entry_id):  # [gateway hook]
                    continue
                self.control_cursor = entry_id.decode()
                try:
                    cmd = control.decode_entry(entry_id, fields)
                except EventError as exc:
                    self._dead_letter(self.keys.control, entry_id, str(exc))
                    continue
                if isinstance(cmd, control.Command):
                    self._obey(cmd)

    def _obey(self, cmd: control.Command) -> None:
        ok, error = True, ""
        if cmd.cmd == "pause":
            self._pause()
        elif cmd.cmd == "load":
            try:
                self._load(cmd.version, cmd.path, cmd.sha256)
            except (OSError, EngineError, ValueError) as exc:
                ok, error = False, str(exc)
                self.log.error("weights refused; keeping old version", version=cmd.version,
                               current=self.engine.version, error=error)
        elif cmd.cmd == "resume":
            self._resume()
        self.client.xadd(self.keys.control, control.ack(cmd, self.worker_id, ok, self.engine.version, error))
        self.heartbeat()

    def _pause(self) -> None:
        """Abort generation and make every token durable; tools keep running."""
        if not self.paused:
            self._abort_generation("pause")
            self._check_flush(self.events.flush())
            self.paused = True

    def _resume(self) -> None:
        if self.paused:
            self.paused = False
            self._resume_paused()
            self.calls.resume()  # [gateway hook]

    def _load(self, version: int, path: str, sha256: str) -> None:
        if sha256:
            actual = sha256_file(Path(path))
            if actual != sha256:
                raise ValueError(f"weights {path}: sha256 {actual[:12]}... does not match the published "
                                 f"{sha256[:12]}... (corrupt or truncated file)")
        was_running = not self.paused
        self._pause()
        try:
            self.engine.load_weights(path, version)
        finally:
            if was_running:
                self._resume()
        self.log.info("weights loaded", version=version)

    def _resume_paused(self) -> None:
        for live in list(self.live.values()):
            if live.state is State.PAUSED:
                self._resume_one(live)

    def _resume_one(self, live: LiveEpisode) -> None:
        """Continue an aborted episode from what its stream says, not from memory."""
        ep = self.events.replay(live.episode_id)
        if ep.tokens != live.tokens:
            self.log.error("stream and memory disagree; continuing from the stream", episode=live.episode_id,
                           stream_tokens=len(ep.tokens), memory_tokens=len(live.tokens))
            live.tokens, live.num_generated = list(ep.tokens), ep.num_generated
        self.events.append(live.episode_id, "resumed", {"num_tokens": len(ep.tokens)}, self.engine.version)
        self.stats["resumed"] += 1
        self._generate(live)


@dataclass
class ToolCallProblem:
    message: str
