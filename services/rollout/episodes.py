"""The episodes a rollout worker drives: opening a group's episodes from their streams, generation requests,
recording tokens, tool calls and results, scoring and ending; every event goes to the episode's stream.

Ownership: an episode is this worker's while it is in ``live``; every write path checks that first. When an
append is fenced (another worker owns the episode now), the whole group leaves this worker at once: its live
episodes, engine requests, tool and reward jobs and log buffers; nothing later touches it, and a group this
worker gets back starts clean (``open_groups``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

from services.rollout.agent import Agent, Finish, ToolCall
from services.rollout.engine import Chunk, EngineError, SamplingParams
from services.rollout.episode import LiveEpisode, State, episode_seed
from services.rollout.groups import GroupRun, Groups
from services.rollout.prompting import prompt_ids
from services.rollout.tool_jobs import Outcome, ToolJobs
from services.rollout.writer import StepWriter
from shared.protocol.episode_log import EpisodeLog, Fenced
from shared.protocol.events import EventError, decode
from shared.protocol.fold import fold
from shared.runtime.faults import crash_point


class Episodes:
    def __init__(self, cfg, events: EpisodeLog, engine, tokenizer, agent: Agent, jobs: ToolJobs, groups: Groups,
                 reward, stop_token_ids: tuple[int, ...], log):
        self.cfg, self.events, self.engine, self.tok, self.agent = cfg, events, engine, tokenizer, agent
        self.jobs, self.groups, self.reward, self.stop_token_ids, self.log = jobs, groups, reward, stop_token_ids, log
        self.worker_id = events.worker
        self.live: dict[str, LiveEpisode] = {}
        self.paused = False
        self.stats = {"tokens": 0, "episodes": 0, "resumed": 0}
        self._closing: list[LiveEpisode] | None = None  # during one_flush(): episodes ended in this step
        self._ending: list[LiveEpisode] = []  # ended in a step; closed once their last events are in Redis
        self.writer = StepWriter(f"step-writer-{self.worker_id}")  # the step's round trip, beside the next step
        self.replies: list = []  # what the worker's wake read sent with a batch returned (``send_step``)
        self._sent: set[str] = set()  # episodes with events in the batch in flight

    def owns(self, live: LiveEpisode) -> bool:
        return self.live.get(live.episode_id) is live

    # --- opening a group
    def open_groups(self, runs: list[GroupRun]) -> None:
        """Open groups claimed or taken over together: one round trip reads every episode stream of them all, one
        more makes every new episode's start durable."""
        if not runs:
            return
        if self._in_flight([episode_id for run in runs for episode_id in run.episodes]):
            self.settle()  # a group this worker held before: nothing of it in flight while its streams are read
        for run in runs:
            self._forget_group(run.group.group_id)  # a group this worker held before (lost, now back): from its streams
            self.groups.hold(run)
        streams = iter(self.events.read_many([episode_id for run in runs for episode_id in run.episodes]))
        fresh = []
        for run in runs:
            for index, (episode_id, entries) in enumerate(zip(run.episodes, [next(streams) for _ in run.episodes])):
                if not self.groups.holds(run):
                    continue  # lost while opening (fenced): nothing more touches it
                if entries:
                    self._resume_from_stream(run, episode_id, entries)
                elif (live := self._start(run, index, episode_id)) is not None:
                    fresh.append(live)
        if fresh:
            self.flush([live.episode_id for live in fresh])
            crash_point("rollout", "opened")  # tests only (shared/runtime/faults.py)
        for live in fresh:
            if self.owns(live):
                self._generate(live)
        for run in runs:
            self.groups.maybe_publish(run)

    def _params(self, run: GroupRun, index: int) -> SamplingParams:
        o, c = run.group.sampling, self.cfg
        return SamplingParams(temperature=float(o.get("temperature", c.temperature)),
                              top_p=float(o.get("top_p", c.top_p)), top_k=int(o.get("top_k", c.top_k)),
                              max_tokens=int(o.get("max_tokens", c.max_tokens)), stop_token_ids=self.stop_token_ids,
                              seed=int(o.get("seed", episode_seed(c.seed, run.group.group_id, index))))

    def _start(self, run: GroupRun, index: int, episode_id: str) -> LiveEpisode | None:
        """A new episode (its stream is empty): the ``started`` event, buffered; the caller flushes it and
        starts generation. None when it failed at once (prompt too long)."""
        group = run.group
        params = self._params(run, index)
        live = LiveEpisode(episode_id, group.group_id, index, prompt_ids(self.tok, group), params, group.task)
        self.live[episode_id] = live
        self.events.open(episode_id)
        self._append(live, "started", {"episode_id": episode_id, "group_id": group.group_id, "index": index,
                                       "prompt_ids": live.prompt_ids, "sampling": params.to_dict(), "task": group.task})
        if len(live.prompt_ids) + 1 > self.engine.max_model_len:
            self._fail(live, f"prompt of {len(live.prompt_ids)} tokens does not fit the model's context of "
                             f"{self.engine.max_model_len} tokens (prompt group entry {group.entry_id})", "prompt")
            return None
        return live

    def _resume_from_stream(self, run: GroupRun, episode_id: str, entries) -> None:
        try:
            ep = fold(entries)
        except EventError as exc:
            self.groups.dead_letter(self.events.keys.episode(episode_id), exc.entry_id, str(exc))
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
        takeover = run.takeover_from is not None and ep.last_worker != self.worker_id
        repacked = run.repack is not None and ep.last_worker == run.repack.source != self.worker_id
        self._append(live, "resumed", {"num_tokens": len(ep.tokens),
                                       **({"takeover_from": ep.last_worker} if takeover else {}),
                                       **({"repacked": ep.last_worker} if repacked else {})})
        self.stats["resumed"] += 1
        self.log.info("episode resumed from stream", episode=episode_id, tokens=len(ep.tokens),
                      takeover_from=ep.last_worker if takeover else None)
        if ep.pending_tool_calls:  # the stream stopped between a call and its result: answer it first
            c = ep.pending_tool_calls[-1]
            self._run_call(live, self.agent.checked(ToolCall(c["call_id"], c["name"], c["args"])), attach=True)
        else:
            self.flush([episode_id])
            if self.owns(live):
                self._generate(live)

    # --- generation
    def _generate(self, live: LiveEpisode) -> None:
        if self.paused:
            live.state = State.PAUSED
            return
        end = self.agent.next_turn(live)
        if end is not None:
            return self._end(live, end.reason)
        try:
            self.engine.add_request(live.episode_id, live.context_ids, live.params, live.remaining,
                                    start_index=len(live.tokens))
        except EngineError as exc:
            return self._fail(live, str(exc), "engine")
        live.state = State.GENERATING

    def on_chunk(self, chunk: Chunk) -> None:
        live = self.live.get(chunk.request_id)
        if live is None:
            return
        self._record(live, chunk)
        step = self.agent.after_chunk(live, chunk.finish_reason)
        if step is not None and chunk.finish_reason is None:  # a call (or the tool limit) ends this turn
            rest = self.engine.abort(live.episode_id)
            if rest is not None:
                self._record(live, rest)
        if isinstance(step, ToolCall):
            self._append(live, "tool_call", {"call_id": step.call_id, "name": step.name, "args": step.args})
            self._run_call(live, step)
        elif isinstance(step, Finish):
            self._end(live, step.reason)

    def _record(self, live: LiveEpisode, chunk: Chunk) -> None:
        if chunk.token_ids:
            self.events.append_tokens(live.episode_id, chunk.token_ids, chunk.logprobs, chunk.version)
            self.agent.add_generated(live, chunk.token_ids)
            self.stats["tokens"] += len(chunk.token_ids)

    def abort_all(self, reason: str, chunks=None) -> None:
        """Stop generating; every episode that was generating gets an ``aborted`` event (buffered). ``chunks``:
        what ``engine.abort_all()`` returned for these episodes when the caller aborted the engine itself."""
        for chunk in self.engine.abort_all() if chunks is None else chunks:
            if (live := self.live.get(chunk.request_id)) is not None:
                self._record(live, chunk)
        for live in self.live.values():
            if live.state in (State.GENERATING, State.PAUSED):
                live.state = State.PAUSED
                self._append(live, "aborted", {"reason": reason, "num_tokens": len(live.tokens)})

    def stop_group(self, group_id: str, reason: str) -> list[LiveEpisode] | None:
        """Stop generating the group's episodes here (an ``aborted`` event each) and make every event of the group
        durable, so that it can leave this worker (a repack). The episodes that were generating, or None when
        the group is no longer this worker's (fenced while flushing: dropped)."""
        mine = [live for live in self.live.values() if live.group_id == group_id]
        stopped = [live for live in mine if live.state is State.GENERATING]
        for live in stopped:
            if (rest := self.engine.abort(live.episode_id)) is not None:
                self._record(live, rest)
            live.state = State.PAUSED
            self._append(live, "aborted", {"reason": reason, "num_tokens": len(live.tokens)})
        self.flush([live.episode_id for live in mine])
        return stopped if self.groups.get(group_id) is not None and all(map(self.owns, mine)) else None

    def forget_group(self, group_id: str) -> None:
        """The group has left this worker (handed over): forget it (``_forget_group``)."""
        self._forget_group(group_id)

    def resume_all(self) -> None:
        """Continue every aborted episode from what its stream says, not from memory."""
        for live in list(self.live.values()):
            if not self.owns(live) or live.state is not State.PAUSED:
                continue
            ep = self.events.replay(live.episode_id)
            if ep.tokens != live.tokens:
                self.log.error("stream and memory disagree; continuing from the stream", episode=live.episode_id,
                               stream_tokens=len(ep.tokens), memory_tokens=len(live.tokens))
                live.tokens, live.num_generated = list(ep.tokens), ep.num_generated
            self._append(live, "resumed", {"num_tokens": len(ep.tokens)})
            self.stats["resumed"] += 1
            self._generate(live)

    # --- tools and rewards (rq jobs)
    def _run_call(self, live: LiveEpisode, call: ToolCall, attach: bool = False) -> None:
        if call.error is not None:
            return self._tool_result(live, call.call_id, False, call.error)
        self.flush([live.episode_id])  # the call is durable before its job exists: a takeover re-attaches to it
        if self.owns(live):
            self.jobs.tool(live.episode_id, call.call_id, call.name, call.args, attach=attach)
            live.state = State.TOOL

    def on_job(self, outcome: Outcome) -> None:
        live = self.live.get(outcome.episode_id)
        if live is None:
            return
        if outcome.kind == "tool":
            return self._tool_result(live, outcome.call_id, outcome.ok, str(outcome.value))
        if not outcome.ok:
            return self._fail(live, f"reward function {self.reward.spec} raised {outcome.value}", "reward")
        reward, details = outcome.value
        self._finished(live, live.finish_reason or "stop", float(reward), dict(details or {}))

    def _tool_result(self, live: LiveEpisode, call_id: str, ok: bool, output: str) -> None:
        ids = self.agent.result_ids(ok, output)
        self._append(live, "tool_result", {"call_id": call_id, "ok": ok, "output": output, "ids": ids})
        self.flush([live.episode_id])
        if self.owns(live):
            self.agent.add_result(live, ids)
            live.state = State.PAUSED
            self._generate(live)

    # --- endings
    def _end(self, live: LiveEpisode, reason: str) -> None:
        """Generation is over: score the response (in-process for an inline reward, else an rq job)."""
        response = self.tok.decode(live.tokens, skip_special_tokens=True)
        if not self.reward.inline:
            live.state, live.finish_reason = State.SCORING, reason
            return self._score_group(live.group_id) if self.reward.group_aware else self._score([live])
        try:
            reward, details = self.reward(response, live.task)
        except Exception as exc:  # a user's reward function can raise anything
            return self._fail(live, f"reward function {self.reward.spec} raised {exc.__class__.__name__}: {exc}",
                              "reward")
        self._finished(live, reason, reward, details)

    def _score(self, scoring: list[LiveEpisode], group: list | None = None, read: list[LiveEpisode] = ()) -> None:
        # every response the job reads (``read``: the whole group for a group-aware reward) is made durable first:
        # a worker that takes the episode over re-attaches to this job (its id comes from the episode), so its
        # result must be for the tokens in the streams
        self.flush([live.episode_id for live in read or scoring])
        for live in scoring:
            if not self.owns(live):
                continue  # fenced while flushing: another worker owns the group now
            prompt = self.tok.decode(live.prompt_ids, skip_special_tokens=True)
            response = self.tok.decode(live.tokens, skip_special_tokens=True)
            self.jobs.reward(live.episode_id, prompt, response, live.task, group)

    def _score_group(self, group_id: str) -> None:
        """Group-aware reward: once none of the group's episodes here is still generating, score them together."""
        members = sorted((l for l in self.live.values() if l.group_id == group_id), key=lambda l: l.index)
        if not members or any(l.state is not State.SCORING for l in members):
            return
        group = [{"index": l.index, "response": self.tok.decode(l.tokens, skip_special_tokens=True)}
                 for l in members]
        self._score([l for l in members if l.episode_id not in self.jobs.pending], group, read=members)

    def _finished(self, live: LiveEpisode, reason: str, reward: float, details: dict) -> None:
        self._append(live, "finished", {"reason": reason, "reward": reward, "details": details})
        self._close(live)

    def _fail(self, live: LiveEpisode, error: str, where: str) -> None:
        self.log.warning("episode failed", episode=live.episode_id, error=error, where=where)
        self._append(live, "failed", {"error": error, "where": where})
        self._close(live)

    @contextmanager
    def one_flush(self):
        """Inside, an ending episode's last events are not written at once: they go with the step's batch
        (``send_step``: one round trip per engine step, not one per finishing episode, beside the next step), and
        the episode is closed, its group published if complete, once that batch is settled."""
        self._closing = []
        try:
            yield
        finally:
            closing, self._closing = self._closing, None
            self._ending += closing
            for live in closing:
                if (run := self.groups.get(live.group_id)) is not None:
                    run.ended.add(live.episode_id)

    def send_step(self, wake_read: Callable | None = None) -> None:
        """After an engine step: this step's writes leave on the writer thread in one pipeline, while the caller
        runs the next step. They are the events of every episode that ended in the step, every buffered event
        when any is due by count or age, the publishes of groups completed by the batch settled last, and
        ``wake_read(pipe)``: the worker's non-blocking read of the streams that wake it, whose reply comes back
        in ``replies`` once settled."""
        self.settle()
        ending, self._ending = self._ending, []
        batch = self.events.take(None if self.events.due() else [live.episode_id for live in ending])
        publishing = self.groups.take_queued()
        if not batch and wake_read is None and not publishing:
            for live in ending:  # nothing of theirs is buffered or in flight: their end is in Redis already
                self._closed(live)
            return

        def also(pipe):
            self.groups.add(pipe, publishing)
            if wake_read is not None:
                wake_read(pipe)
        self._sent = {episode_id for episode_id, _ in batch.targets}
        self.writer.submit(lambda: self.events.send(batch, also), (batch, ending, publishing))

    def settle(self, publish_later: bool = False) -> None:
        """Wait for the batch in flight, if any, and apply its results: a fenced episode drops its group (a step
        later than a synchronous flush would, and before anything of the group is published); an ending episode
        whose last events are now in Redis is closed and its group published when complete (with
        ``publish_later``, in the next step's pipeline)."""
        if not self.writer.in_flight:
            return
        (results, extra), (batch, ending, publishing) = self.writer.wait()
        written = self.events.entries_written
        errors = self.events.settle(batch, results)
        self.groups.settle(publishing, extra[:len(publishing)])
        for reply in extra[len(publishing):]:
            if isinstance(reply, Exception):
                raise reply
            self.replies.append(reply)
        self._written(written, errors)
        for live in ending:
            self._closed(live, publish_later)

    def _in_flight(self, episode_ids: list[str] | None) -> bool:
        """Whether the batch in flight holds events of these episodes (of any, for None)."""
        return self.writer.in_flight and (episode_ids is None or not self._sent.isdisjoint(episode_ids))

    def close_writer(self) -> None:
        self.settle()
        self.writer.close()

    def _close(self, live: LiveEpisode) -> None:
        live.state = State.DONE
        if self._closing is not None:
            self._closing.append(live)
            return
        self.flush([live.episode_id])
        self._closed(live)

    def _closed(self, live: LiveEpisode, publish_later: bool = False) -> None:
        """After the episode's end is in its stream: forget it here, publish its group when complete."""
        if not self.owns(live):
            return
        self.events.close(live.episode_id)
        del self.live[live.episode_id]
        self.stats["episodes"] += 1
        run = self.groups.get(live.group_id)
        if run is not None:
            run.done.add(live.episode_id)
            self.groups.maybe_publish(run, later=publish_later)
        if self.reward.group_aware:  # the rest of the group may have been waiting for this one
            self._score_group(live.group_id)

    # --- the log and ownership
    def _append(self, live: LiveEpisode, kind: str, data: dict) -> None:
        if self.owns(live):
            self.events.append(live.episode_id, kind, data, self.engine.version)

    def flush(self, episode_ids: list[str] | None = None, due_only: bool = False) -> None:
        """Write buffered events now (after the batch in flight when it holds any of these episodes); a fenced
        episode drops its group (other errors raise). An episode that ended in a step and is now all written is
        closed."""
        if due_only or self._in_flight(episode_ids):
            self.settle()
        written = self.events.entries_written
        errors = self.events.maybe_flush() if due_only else self.events.flush(episode_ids)
        self._written(written, errors)
        if self._ending:
            done = [live for live in self._ending if self.events.written(live.episode_id)]
            self._ending = [live for live in self._ending if live not in done]
            for live in done:
                self._closed(live)
        self.groups.publish_queued()

    def _written(self, entries_before: int, errors: dict[str, Exception]) -> None:
        if self.events.entries_written > entries_before:
            crash_point("rollout", "flushed")  # tests only (shared/runtime/faults.py)
        lost: dict[str, str] = {}
        for episode_id, exc in errors.items():
            if not isinstance(exc, Fenced):
                raise exc
            live = self.live.get(episode_id)
            lost.setdefault(live.group_id if live else episode_id.rsplit("-", 1)[0], episode_id)
        for group_id, episode_id in lost.items():
            self.log.warning("fenced: another worker owns this group now; dropping it", group=group_id,
                             episode=episode_id, new_owner=self._writer_of(episode_id))
            self._forget_group(group_id)

    def _writer_of(self, episode_id: str) -> str:
        last = self.events.client.xrevrange(self.events.keys.episode(episode_id), count=1)
        try:
            return decode(*last[0]).worker if last else "?"
        except EventError:
            return "?"

    def _forget_group(self, group_id: str) -> None:
        """Drop every trace of a group from this worker: episodes, engine requests, jobs, log buffers."""
        mine = [eid for eid, live in self.live.items() if live.group_id == group_id]
        for episode_id in mine:
            self.engine.abort(episode_id)
            self.events.close(episode_id)
            del self.live[episode_id]
        self._ending = [live for live in self._ending if live.group_id != group_id]
        self.jobs.forget(mine)
        self.groups.drop(group_id)
