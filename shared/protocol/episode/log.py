"""The episode log: batched, fenced appends to ``ep:<id>`` streams, and replay.

A writer buffers events per episode and sends them in one pipeline when an
episode has ``flush_tokens`` tokens pending or the oldest pending event is
``flush_ms`` old (``maybe_flush``), or when asked (``flush``). Consecutive
token chunks of one policy version coalesce into one ``tokens`` event.

Every append is fenced: a server-side script checks that the stream's length
(XLEN) is the ``seq`` this writer expects next before adding. That is the last
entry's seq + 1 because every entry of an episode stream is appended by this
script with seq = its position (fold refuses a gap or a duplicate), and no
code deletes or trims an episode stream. Two writers can never interleave in
one episode (a worker presumed dead that wakes up, say), and a writer ahead of
the stream (the server lost its tail) cannot append either: the loser gets
``Fenced`` and must drop the episode.

An ended episode takes nothing more: the script refuses a batch that has
events after its own terminal one (``finished``/``failed``), and, for a
writer made with ``guard_end`` (the default), a batch for a stream whose last
entry is terminal, whoever wrote it. The writer gets ``Ended`` (a ``Fenced``:
it drops the episode the same way). Agent episodes have several writers
appending at the tail (the agent runner, each worker serving a call), so a
``resumed`` or ``tokens`` that loses a race with the runner's end is refused by
the server and an episode stream always folds. Reading the last entry doubles
the server's time per appended entry, so the rollout worker's own writer of
plain episodes is made without it: it is their only writer (the seq fence
keeps out any other), writes their end last, and a takeover folds the stream
before it opens it.

On one server a batch is one script call for all its episodes (the fence is
per episode: a fenced one leaves the others written); on a cluster, where the
streams live in different slots, one call per episode, routed to its node.
The header fields shared by every event of a batch (``v``, ``worker``) and the
seq (the expected one, counted up) travel once per call, not once per event.

A flush is three parts, so that the round trip can run in another thread while
the caller goes on (``services/rollout/episodes/step_writer.py``): ``take`` moves buffered
events into a ``Batch`` (events appended meanwhile get the seqs after it),
``send`` writes it in one pipeline (with any other commands the caller adds to
the same pipeline), ``settle`` applies the results. One batch at a time: an
episode with a batch in flight cannot be taken again before it is settled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import redis

from shared.protocol.episode.events import SCHEMA_VERSION, Event, encode_data
from shared.protocol.episode.fold import Episode, fold
from shared.protocol.keys import Keys
from shared.protocol.streams.routing import node_of

_APPEND = """
local v, worker, guard, out, a = ARGV[1], ARGV[2], ARGV[3] == '1', {}, 4
local function terminal(kind) return kind == 'finished' or kind == 'failed' end
for k = 1, #KEYS do
  local seq, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  a = a + 2
  local len = redis.pcall('XLEN', KEYS[k])
  if type(len) == 'table' then
    out[k] = 'ERROR ' .. tostring(len.err)
  elseif len ~= seq then
    out[k] = 'FENCED stream holds ' .. len .. ' entries (next seq ' .. len .. '), writer expected seq ' .. seq
  else
    if guard and len > 0 then
      local last = redis.call('XREVRANGE', KEYS[k], '+', '-', 'COUNT', 1)[1][2]
      if last[1] == 'type' and terminal(last[2]) then
        out[k] = 'ENDED the stream ends with ' .. last[2] .. ' at seq ' .. (len - 1)
      end
    end
    for i = 0, n - 2 do
      if not out[k] and terminal(ARGV[a + 3 * i]) then
        out[k] = 'ENDED the batch has events after its ' .. ARGV[a + 3 * i] .. ' (seq ' .. (seq + i) .. ')'
      end
    end
    if not out[k] then
      for i = 0, n - 1 do
        local j = a + 3 * i
        redis.call('XADD', KEYS[k], '*', 'type', ARGV[j], 'v', v, 'policy', ARGV[j + 1], 'worker', worker,
                   'seq', seq + i, 'data', ARGV[j + 2])
      end
      out[k] = n
    end
  end
  a = a + 3 * n
end
return out
"""


class Fenced(RuntimeError):
    """Another writer appended to this episode; this writer no longer owns it."""

    def __init__(self, episode_id: str, detail: str):
        self.episode_id = episode_id
        super().__init__(f"episode {episode_id}: {detail}")


class Ended(Fenced):
    """The episode's stream already ends with its terminal event; nothing may follow it."""


@dataclass
class _Pending:
    # seq of the first event not yet written
    next_seq: int
    events: list[Event] = field(default_factory=list)
    num_tokens: int = 0
    # clock time of the oldest unwritten event
    since: float | None = None
    # events taken into a batch not settled yet (their seqs follow next_seq)
    inflight: int = 0


@dataclass
class _Taken:
    # seq of the batch's first event for this episode
    next_seq: int
    events: list[Event]
    # the buffer it came from (a closed or re-opened episode has another, or none)
    pending: _Pending


@dataclass
class Batch:
    """Events taken out of the buffers: ``send`` writes them, ``settle`` applies the results."""

    targets: list[tuple[str, _Taken]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.targets)


class EpisodeLog:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        worker: str,
        flush_tokens: int = 16,
        flush_ms: float = 50.0,
        clock=time.monotonic,
        archive=None,
        guard_end: bool = True,
    ):
        self.client, self.keys, self.worker = client, keys, worker
        # refuse appends to a stream that already ends with its terminal event (see the module's docstring)
        self.guard_end = guard_end
        # a SegmentStore (shared/protocol/archive/segments.py): readers' cold tier, or None
        self.archive = archive
        self.flush_tokens, self.flush_ms, self.clock = flush_tokens, flush_ms, clock
        self._sha = client.script_load(_APPEND)
        # see shared/protocol/streams/routing.py
        self._cluster = hasattr(client, "get_node_from_key")
        self._pending: dict[str, _Pending] = {}
        self.entries_written = 0

    # --- writing
    def open(self, episode_id: str, next_seq: int = 0) -> None:
        """Start writing an episode whose stream holds ``next_seq`` events."""
        self._pending[episode_id] = _Pending(next_seq)

    def close(self, episode_id: str) -> None:
        self._pending.pop(episode_id, None)

    def append(self, episode_id: str, kind: str, data: dict, policy: int) -> None:
        p = self._pending[episode_id]
        seq = p.next_seq + p.inflight + len(p.events)
        p.events.append(Event(kind=kind, policy=policy, worker=self.worker, seq=seq, data=data))
        if p.since is None:
            p.since = self.clock()

    def append_tokens(
        self, episode_id: str, ids: list[int], logprobs: list[float], policy: int, routes=None, call: int | None = None
    ) -> None:
        """Buffer generated tokens (with their routes [n, layers, top_k] when the policy records them; of ``call``
        in an agent episode), joined to the pending ``tokens`` event when it is of the same version and call."""
        if not ids:
            return
        p = self._pending[episode_id]
        last = p.events[-1] if p.events else None
        if (
            last is not None
            and last.kind == "tokens"
            and last.policy == policy
            and last.data.get("call") == call
            and ("routes" in last.data) == (routes is not None)
        ):
            last.data["ids"] += ids
            last.data["logprobs"] += logprobs
            if routes is not None:
                last.data["routes"] = np.concatenate([last.data["routes"], routes])
        else:
            data = {"ids": list(ids), "logprobs": list(logprobs)}
            if call is not None:
                data["call"] = call
            if routes is not None:
                data["routes"] = routes
            self.append(episode_id, "tokens", data, policy)
        p.num_tokens += len(ids)

    def pending_tokens(self, episode_id: str) -> int:
        return self._pending[episode_id].num_tokens

    def written(self, episode_id: str) -> bool:
        """Every event appended to this episode is in its stream (none buffered, none in flight)."""
        p = self._pending.get(episode_id)
        return p is None or (not p.events and not p.inflight)

    def due(self) -> bool:
        now = self.clock()
        return any(
            p.num_tokens >= self.flush_tokens or (p.since is not None and (now - p.since) * 1000 >= self.flush_ms)
            for p in self._pending.values()
        )

    def next_due(self) -> float | None:
        """When (on this log's clock) the oldest buffered event falls due by age; None when none is buffered."""
        return min(
            (p.since + self.flush_ms / 1000 for p in self._pending.values() if p.since is not None), default=None
        )

    def maybe_flush(self) -> dict[str, Exception]:
        return self.flush() if self.due() else {}

    def flush(self, episode_ids: list[str] | None = None) -> dict[str, Exception]:
        """Write pending events (of all episodes, or those named) in one pipeline, now.

        Returns {episode_id: error} for episodes that could not be written;
        a fenced episode is closed (its pending events dropped).
        """
        batch = self.take(episode_ids)
        if not batch:
            return {}
        return self.settle(batch, self.send(batch)[0])

    def take(self, episode_ids: list[str] | None = None) -> Batch:
        """Move the pending events (of all episodes, or those named) into a batch for ``send``."""
        wanted = None if episode_ids is None else set(episode_ids)
        batch = Batch()
        for episode_id, p in self._pending.items():
            if not p.events or (wanted is not None and episode_id not in wanted):
                continue
            if p.inflight:
                raise RuntimeError(f"episode {episode_id}: a batch of its events is in flight; settle it first")
            batch.targets.append((episode_id, _Taken(p.next_seq, p.events, p)))
            p.inflight, p.events, p.num_tokens, p.since = len(p.events), [], 0, None
        return batch

    def send(self, batch: Batch, also: Callable | None = None) -> tuple[list, list]:
        """Write a batch in one pipeline (safe to call from another thread: it touches nothing but the batch and
        a pipeline of its own). ``also(pipe)`` adds the caller's other commands to the same round trip.
        Returns (one result per episode, the results of ``also``'s commands); errors are returned, not raised."""
        results = self._send(batch.targets, also)
        return results[: len(batch.targets)], results[len(batch.targets) :]

    def send_and_read(self, batch: Batch, episode_ids: list[str]) -> tuple[list, list[list[tuple]]]:
        """``send`` the batch and ``read_many`` these episodes in the same round trip, the reads after the writes.
        Returns (one result per episode of the batch, as ``send``; the streams read). A read error raises."""

        def reads(pipe):
            for episode_id in episode_ids:
                pipe.xrange(self.keys.episode(episode_id))

        results, streams = self.send(batch, reads)
        for entries in streams:
            if isinstance(entries, Exception):
                raise entries
        return results, streams

    def settle(self, batch: Batch, results: list) -> dict[str, Exception]:
        """Apply ``send``'s results: written events leave the buffers, a fenced episode is closed. Returns
        {episode_id: error} as ``flush`` does. A server that forgot the script (restarted) gets it again and
        the episodes it refused are written now."""
        retry = [i for i, r in enumerate(results) if isinstance(r, redis.exceptions.NoScriptError)]
        if retry:
            self._sha = self.client.script_load(_APPEND)
            again = self._send([batch.targets[i] for i in retry])
            results = list(results)
            for i, result in zip(retry, again):
                results[i] = result
        errors: dict[str, Exception] = {}
        for (episode_id, taken), result in zip(batch.targets, results):
            p = taken.pending
            current = self._pending.get(episode_id) is p
            if isinstance(result, Exception):
                if "FENCED" in str(result) or "ENDED" in str(result):
                    errors[episode_id] = (Ended if "ENDED" in str(result) else Fenced)(episode_id, str(result))
                    if current:
                        self.close(episode_id)
                else:
                    errors[episode_id] = result
                    # not written: back in front of what was appended since (same seqs)
                    if current:
                        p.events, p.inflight = taken.events + p.events, 0
                continue
            self.entries_written += result
            if current:
                p.next_seq += len(taken.events)
                p.inflight = 0
        return errors

    def _send(self, targets: list[tuple[str, _Taken]], also: Callable | None = None) -> list:
        """One pipeline: the append script for the targets (one call on a single server, one per episode on a
        cluster), then ``also``'s commands. Returns one result per target (the number of entries written, or
        an exception), then ``also``'s results. Sent as a raw command: a cluster pipeline refuses ``evalsha()``
        but routes the command by its key like any other (the script is loaded on every primary by
        ``script_load``); redis-py's ``Script`` would add a SCRIPT EXISTS round trip."""
        pipe = self.client.pipeline(transaction=False)
        calls = [targets] if targets and not self._cluster else [[t] for t in targets]
        for group in calls:
            keys = [self.keys.episode(episode_id) for episode_id, _ in group]
            args: list = [str(SCHEMA_VERSION), self.worker, "1" if self.guard_end else "0"]
            for _, t in group:
                args += (t.next_seq, len(t.events))
                for ev in t.events:
                    args += (ev.kind, ev.policy, encode_data(ev))
            pipe.execute_command("EVALSHA", self._sha, len(keys), *keys, *args, **node_of(self.client, keys[0]))
        if also is not None:
            also(pipe)
        replies = pipe.execute(raise_on_error=False)
        results: list = []
        for group, reply in zip(calls, replies):
            if isinstance(reply, Exception):
                results += [reply] * len(group)
            else:
                results += [
                    r
                    if isinstance(r, int)
                    else redis.exceptions.ResponseError(r.decode() if isinstance(r, bytes) else r)
                    for r in reply
                ]
        return results + replies[len(calls) :]

    def flush_or_raise(self, episode_ids: list[str] | None = None) -> None:
        errors = self.flush(episode_ids)
        if errors:
            raise next(iter(errors.values()))

    # --- reading
    def read(self, episode_id: str) -> list[tuple]:
        """The episode's entries: from its Redis stream, else (moved out) from the archive's segments."""
        entries = self.client.xrange(self.keys.episode(episode_id))
        if not entries and self.archive is not None:
            return self.archive.read(episode_id)
        return entries

    def read_many(self, episode_ids: list[str]) -> list[list[tuple]]:
        """``read`` of several episodes in one round trip (one more read of the segments for those moved out)."""
        pipe = self.client.pipeline(transaction=False)
        for episode_id in episode_ids:
            pipe.xrange(self.keys.episode(episode_id))
        found = pipe.execute()
        missing = [eid for eid, entries in zip(episode_ids, found) if not entries]
        if missing and self.archive is not None:
            cold = self.archive.read_many(missing)
            found = [entries or cold.get(eid, []) for eid, entries in zip(episode_ids, found)]
        return found

    def replay(self, episode_id: str) -> Episode:
        return fold(self.read(episode_id))
