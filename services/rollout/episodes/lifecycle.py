"""The episodes a rollout worker drives: opening a group's episodes from their streams, generation requests,
recording tokens, tool calls and results, scoring and ending; every event goes to the episode's stream.

Ownership: an episode is this worker's while it is in ``live``; every write path checks that first. When an
append is fenced (another worker owns the episode now), the whole group leaves this worker at once: its live
episodes, engine requests, tool and reward jobs and log buffers; nothing later touches it, and a group this
worker gets back starts clean (``open_groups``). When the writes travel, and what their results do (an ended
episode closed, a fenced group dropped): ``settlement.py``.
"""

from __future__ import annotations

from services.rollout.engine import Chunk, EngineError, SamplingParams
from services.rollout.episodes.agent_loop import Agent, Finish, ToolCall
from services.rollout.episodes.live import LiveEpisode, State, episode_seed
from services.rollout.episodes.prompting import prompt_ids
from services.rollout.episodes.settlement import Writes
from services.rollout.groups.claims import GroupRun, Groups
from services.rollout.jobs.tool_jobs import Outcome, ToolJobs
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import decode
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.runtime.faults import crash_point


class Episodes:
    def __init__(
        self,
        cfg,
        events: EpisodeLog,
        engine,
        tokenizer,
        agent: Agent,
        jobs: ToolJobs,
        groups: Groups,
        reward,
        stop_token_ids: tuple[int, ...],
        log,
    ):
        self.cfg, self.engine, self.tok, self.agent = cfg, engine, tokenizer, agent
        self.jobs, self.groups, self.reward, self.stop_token_ids, self.log = jobs, groups, reward, stop_token_ids, log
        self.worker_id = events.worker
        self.live: dict[str, LiveEpisode] = {}
        self.paused = False
        self.stats = {"tokens": 0, "episodes": 0, "resumed": 0}
        # when writes travel (settlement.py)
        self.writes = Writes(events, groups, self._closed, self._fenced)

    @property
    def events(self) -> EpisodeLog:
        return self.writes.events

    def owns(self, live: LiveEpisode) -> bool:
        return self.live.get(live.episode_id) is live

    # --- opening a group
    def open_groups(self, runs: list[GroupRun]) -> None:
        """Open groups claimed or taken over together, in one round trip: it writes the ``started`` event of every
        episode of a newly claimed group, fenced at seq 0 (durable before generation starts), and reads the episode
        streams of the others (taken over, repacked). A start refused there (the stream was not empty: a group held
        before) is resumed from its stream, read in a second round trip; a taken-over or repacked group's episodes
        with empty streams are started in a second round trip too."""
        if not runs:
            return
        episode_ids = [episode_id for run in runs for episode_id in run.episodes]
        if self.writes.in_flight(episode_ids):
            # a group this worker held before: nothing of it in flight while its streams are read
            self.writes.settle()
        for run in runs:
            # a group this worker held before (lost, now back): from its streams
            self._forget_group(run.group.group_id)
            self.groups.hold(run)
        # the episodes of newly claimed groups: their streams are empty, but for a group held before
        guessed = {}
        for run in (run for run in runs if run.takeover_from is None and run.repack is None):
            ids = prompt_ids(self.tok, run.group)
            # a prompt too long fails after the read: not guessed
            if len(ids) + 1 <= self.engine.max_model_len:
                guessed.update(
                    (episode_id, self._start(run, index, episode_id, ids))
                    for index, episode_id in enumerate(run.episodes)
                )
        # a started episode's stream holds what was just written: only the others are read back
        reading = [episode_id for episode_id in episode_ids if episode_id not in guessed]
        streams, refused = self.writes.start_and_read(list(guessed), reading)
        found = dict(zip(reading, streams))
        if refused:
            # rare: a newly claimed group was held before; its streams are read in a round trip of their own
            again = sorted(refused)
            found.update(zip(again, self.events.read_many(again)))
        fresh, unwritten = [], []
        for run in runs:
            for index, episode_id in enumerate(run.episodes):
                entries = found.get(episode_id, [])
                if not self.groups.holds(run):
                    # lost while opening (fenced): nothing more touches it
                    continue
                if episode_id in guessed and episode_id not in refused:
                    fresh.append(guessed[episode_id])
                elif entries:
                    # a refused start
                    self.live.pop(episode_id, None)
                    self._resume_from_stream(run, episode_id, entries)
                elif (live := self._start(run, index, episode_id)) is not None:
                    unwritten.append(live)
        if unwritten:
            self.flush([live.episode_id for live in unwritten])
        fresh += unwritten
        if fresh:
            # tests only (shared/runtime/faults.py)
            crash_point("rollout", "opened")
        for live in fresh:
            if self.owns(live):
                self._generate(live)
        for run in runs:
            self.groups.maybe_publish(run)

    def _params(self, run: GroupRun, index: int) -> SamplingParams:
        o, c = run.group.sampling, self.cfg
        return SamplingParams(
            temperature=float(o.get("temperature", c.temperature)),
            top_p=float(o.get("top_p", c.top_p)),
            top_k=int(o.get("top_k", c.top_k)),
            max_tokens=int(o.get("max_tokens", c.max_tokens)),
            stop_token_ids=self.stop_token_ids,
            seed=int(o.get("seed", episode_seed(c.seed, run.group.group_id, index))),
        )

    def _start(self, run: GroupRun, index: int, episode_id: str, ids: list[int] | None = None) -> LiveEpisode | None:
        """A new episode (its stream is empty): the ``started`` event, buffered; the caller flushes it and
        starts generation. None when it failed at once (prompt too long)."""
        group = run.group
        params = self._params(run, index)
        ids = prompt_ids(self.tok, group) if ids is None else ids
        live = LiveEpisode(episode_id, group.group_id, index, list(ids), params, group.task)
        self.live[episode_id] = live
        self.events.open(episode_id)
        self._append(
            live,
            "started",
            {
                "episode_id": episode_id,
                "group_id": group.group_id,
                "index": index,
                "prompt_ids": live.prompt_ids,
                "sampling": params.to_dict(),
                "task": group.task,
            },
        )
        # a poison entry's ids: the episode fails, not the worker
        if any(i >= len(self.tok) for i in live.prompt_ids):
            self._fail(
                live,
                f"prompt token id {max(live.prompt_ids)} is not below the tokenizer's {len(self.tok)} "
                f"(prompt group entry {group.entry_id})",
                "prompt",
            )
            return None
        if len(live.prompt_ids) + 1 > self.engine.max_model_len:
            self._fail(
                live,
                f"prompt of {len(live.prompt_ids)} tokens does not fit the model's context of "
                f"{self.engine.max_model_len} tokens (prompt group entry {group.entry_id})",
                "prompt",
            )
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
        live = LiveEpisode.from_fold(
            ep, SamplingParams.from_dict({**ep.sampling, "stop_token_ids": self.stop_token_ids})
        )
        self.live[episode_id] = live
        self.events.open(episode_id, ep.last_seq + 1)
        takeover = run.takeover_from is not None and ep.last_worker != self.worker_id
        repacked = run.repack is not None and ep.last_worker == run.repack.source != self.worker_id
        self._append(
            live,
            "resumed",
            {
                "num_tokens": len(ep.tokens),
                **({"takeover_from": ep.last_worker} if takeover else {}),
                **({"repacked": ep.last_worker} if repacked else {}),
            },
        )
        self.stats["resumed"] += 1
        self.log.info(
            "episode resumed from stream",
            episode=episode_id,
            tokens=len(ep.tokens),
            takeover_from=ep.last_worker if takeover else None,
        )
        # the stream stopped between a call and its result: answer it first
        if ep.pending_tool_calls:
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
            self.engine.add_request(
                live.episode_id, live.context_ids, live.params, live.remaining, start_index=len(live.tokens)
            )
        except EngineError as exc:
            return self._fail(live, str(exc), "engine")
        live.state = State.GENERATING

    def on_chunk(self, chunk: Chunk) -> None:
        live = self.live.get(chunk.request_id)
        if live is None:
            return
        self._record(live, chunk)
        step = self.agent.after_chunk(live, chunk.finish_reason)
        # a call (or the tool limit) ends this turn
        if step is not None and chunk.finish_reason is None:
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
            self.events.append_tokens(live.episode_id, chunk.token_ids, chunk.logprobs, chunk.version, chunk.routes)
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
                self.log.error(
                    "stream and memory disagree; continuing from the stream",
                    episode=live.episode_id,
                    stream_tokens=len(ep.tokens),
                    memory_tokens=len(live.tokens),
                )
                live.tokens, live.num_generated = list(ep.tokens), ep.num_generated
            self._append(live, "resumed", {"num_tokens": len(ep.tokens)})
            self.stats["resumed"] += 1
            self._generate(live)

    # --- tools and rewards (rq jobs)
    def _run_call(self, live: LiveEpisode, call: ToolCall, attach: bool = False) -> None:
        if call.error is not None:
            return self._tool_result(live, call.call_id, False, call.error)
        # the call is durable before its job exists: a takeover re-attaches to it
        self.flush([live.episode_id])
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
        # a user's reward function can raise anything
        except Exception as exc:
            return self._fail(
                live, f"reward function {self.reward.spec} raised {exc.__class__.__name__}: {exc}", "reward"
            )
        self._finished(live, reason, reward, details)

    def _score(self, scoring: list[LiveEpisode], group: list | None = None, read: list[LiveEpisode] = ()) -> None:
        # every response the job reads (``read``: the whole group for a group-aware reward) is made durable first:
        # a worker that takes the episode over re-attaches to this job (its id comes from the episode), so its
        # result must be for the tokens in the streams
        self.flush([live.episode_id for live in read or scoring])
        for live in scoring:
            if not self.owns(live):
                # fenced while flushing: another worker owns the group now
                continue
            prompt = self.tok.decode(live.prompt_ids, skip_special_tokens=True)
            response = self.tok.decode(live.tokens, skip_special_tokens=True)
            self.jobs.reward(live.episode_id, prompt, response, live.task, group)

    def _score_group(self, group_id: str) -> None:
        """Group-aware reward: once none of the group's episodes here is still generating, score them together."""
        members = sorted((l for l in self.live.values() if l.group_id == group_id), key=lambda l: l.index)
        if not members or any(l.state is not State.SCORING for l in members):
            return
        group = [{"index": l.index, "response": self.tok.decode(l.tokens, skip_special_tokens=True)} for l in members]
        self._score([l for l in members if l.episode_id not in self.jobs.pending], group, read=members)

    def _finished(self, live: LiveEpisode, reason: str, reward: float, details: dict) -> None:
        self._append(live, "finished", {"reason": reason, "reward": reward, "details": details})
        self.writes.close(live)

    def _fail(self, live: LiveEpisode, error: str, where: str) -> None:
        self.log.warning("episode failed", episode=live.episode_id, error=error, where=where)
        self._append(live, "failed", {"error": error, "where": where})
        self.writes.close(live)

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
        # the rest of the group may have been waiting for this one
        if self.reward.group_aware:
            self._score_group(live.group_id)

    # --- the log and ownership
    def _append(self, live: LiveEpisode, kind: str, data: dict) -> None:
        if self.owns(live):
            self.events.append(live.episode_id, kind, data, self.engine.version)

    def flush(self, episode_ids: list[str] | None = None, due_only: bool = False) -> None:
        self.writes.flush(episode_ids, due_only)

    def _fenced(self, episode_ids: list[str]) -> None:
        """Appends refused: another worker owns these episodes' groups now; each group leaves this worker."""
        lost: dict[str, str] = {}
        for episode_id in episode_ids:
            live = self.live.get(episode_id)
            lost.setdefault(live.group_id if live else episode_id.rsplit("-", 1)[0], episode_id)
        for group_id, episode_id in lost.items():
            self.log.warning(
                "fenced: another worker owns this group now; dropping it",
                group=group_id,
                episode=episode_id,
                new_owner=self._writer_of(episode_id),
            )
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
        self.writes.forget(group_id)
        self.jobs.forget(mine)
        self.groups.drop(group_id)
