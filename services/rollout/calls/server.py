"""Serving LLM calls for the gateway: the rollout side of agent episodes.

A ``CallServer`` lives inside a rollout worker. It claims call requests from
the ``calls`` stream (consumer group ``rollout``, like prompt groups), writes
the ``call`` event (or ``resumed`` when the call is already in the stream),
runs the generation on the worker's engine, appends the tokens tagged with the
call, and ends with ``call_done``; the gateway tails the episode stream and
answers the agent. A weight sync aborts the calls like every other request
(``aborted``); on resume each continues from its stream: prompt + the tokens
logged so far, with the budget left (``max_tokens`` - logged). A call whose
worker died is claimed by another worker (pending entries idle for a
heartbeat TTL whose owner's heartbeat key is gone) and continues the same way.

Stop strings (the call's sampling ``stop`` and ``stop_kept``) are matched here,
on the decoded completion, for every engine alike (``engine.stops``): the
tokens logged end at the token that completes one, the engine request is
aborted, and ``call_done`` names the string. A resumed call matches over its
logged prefix + the new tokens, so a string straddling the abort still stops it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from services.rollout.calls.call_log import CallLog
from services.rollout.engine import Chunk, EngineError, SamplingParams
from services.rollout.engine.stops import first_stop
from services.rollout.episodes.live import stable_seed
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import Fenced
from shared.protocol.keys import ROLLOUT_GROUP as GROUP
from shared.protocol.keys import Keys
from shared.protocol.streams import codec, dead_letters
from shared.protocol.streams.calls import CallRequest, decode_request

# engine request ids of calls: call:<episode>:<index>
REQUEST_PREFIX = "call:"


def call_seed(episode_id: str, index: int, digest: str) -> int:
    return stable_seed(episode_id, index, digest)


@dataclass
class LiveCall:
    req: CallRequest
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    # aborted (or opened while the worker was paused): needs a resume
    paused: bool = False

    @property
    def request_id(self) -> str:
        return f"{REQUEST_PREFIX}{self.req.episode_id}:{self.req.call}"

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.tokens)

    @property
    def stops(self) -> tuple[str, ...]:
        return self.params.stop + self.params.stop_kept


# claims follow the wake read; this only bounds the wait for a call it could not see
CLAIM_RECHECK_S = 1.0


class CallServer:
    def __init__(self, cfg, client: redis.Redis, worker_id: str, engine, tokenizer, log):
        self.cfg, self.client, self.worker_id, self.engine = cfg, client, worker_id, engine
        # token ids at or above it would crash the engine
        self.vocab = len(tokenizer)
        self.tok = tokenizer
        self.log = log.bind(part="calls")
        self.keys = Keys(cfg.run)
        self.events = CallLog(client, self.keys, worker_id, cfg.flush_tokens, cfg.flush_ms)
        self.stop_token_ids = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
        # by engine request id
        self.live: dict[str, LiveCall] = {}
        # episode -> live calls of it here (the log stays open while > 0)
        self.open_eps: dict[str, int] = {}
        self.paused = False
        self.cursor = "$"
        self._next_takeover = 0.0
        # claims are event driven: see _claim
        self._claim_wanted, self._next_claim = True, 0.0
        self._missing_since: dict[str, float] = {}
        self.stats = {"calls": 0, "call_tokens": 0, "call_takeovers": 0, "call_resumes": 0}

    def start(self) -> None:
        codec.ensure_group(self.client, self.keys.calls, GROUP)
        last = self.client.xrevrange(self.keys.calls, count=1)
        self.cursor = last[0][0].decode() if last else "0-0"

    def wake_streams(self) -> dict:
        """Streams the worker's idle blocking read also waits on, so that a new call wakes it at once."""
        return {self.keys.calls: self.cursor}

    def saw(self, stream, entry_id) -> bool:
        """Called for each entry of the worker's blocking read; True when it was a call request (now seen)."""
        if (stream.decode() if isinstance(stream, bytes) else stream) != self.keys.calls:
            return False
        self.cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        self._claim_wanted = True
        return True

    def owns(self, request_id: str) -> bool:
        return request_id in self.live

    # --- the tick
    def tick(self, paused: bool) -> None:
        self.paused = paused
        if not paused:
            now = time.monotonic()
            if now >= self._next_takeover:
                self._next_takeover = now + self.cfg.heartbeat_ttl / 2
                self._take_over()
            self._claim(now)
        self._check(self.events.maybe_flush())

    def _claim(self, now: float) -> None:
        """New calls, when the worker's wake read saw one (``saw``), when the last claim filled every free slot
        (more may wait), and at the latest every CLAIM_RECHECK_S: not one read per engine step for nothing."""
        room = self.cfg.max_calls_in_flight - len(self.live)
        if room <= 0 or not (self._claim_wanted or now >= self._next_claim):
            return
        reply = self.client.xreadgroup(GROUP, self.worker_id, {self.keys.calls: ">"}, count=room)
        entries = [e for _, es in reply or [] for e in es]
        self._claim_wanted, self._next_claim = len(entries) >= room, now + CLAIM_RECHECK_S
        for entry_id, fields in entries:
            self.cursor = max(self.cursor, entry_id.decode(), key=_id_key)
            self._open(entry_id, fields)

    def _open(self, entry_id, fields, takeover_from: str | None = None) -> None:
        try:
            req = decode_request(entry_id, fields)
            # a poison entry's ids would crash the engine
            if max(req.prompt_ids) >= self.vocab:
                raise EventError(
                    req.entry_id,
                    "data.prompt_ids",
                    f"token id {max(req.prompt_ids)} is not below the tokenizer's {self.vocab}",
                )
            ep = fold(self.events.read(req.episode_id))
        except EventError as exc:
            self._dead_letter(entry_id, str(exc))
            self.client.xack(self.keys.calls, GROUP, entry_id)
            return
        call = ep.calls.get(req.call)
        if (call is not None and call.done) or (call is None and ep.done):
            # answered already, or nobody waits any more
            self.client.xack(self.keys.calls, GROUP, entry_id)
            return
        s = req.sampling
        params = SamplingParams(
            temperature=float(s.get("temperature", 1.0)),
            top_p=float(s.get("top_p", 1.0)),
            top_k=int(s.get("top_k", 0)),
            max_tokens=int(s["max_tokens"]),
            stop_token_ids=tuple(int(t) for t in s.get("stop_token_ids", self.stop_token_ids)),
            seed=int(s.get("seed", call_seed(req.episode_id, req.call, req.digest))),
            stop=tuple(s.get("stop", ())),
            stop_kept=tuple(s.get("stop_kept", ())),
        )
        live = LiveCall(req, params)
        if live.request_id in self.live:
            return
        self._open_log(req.episode_id, ep.last_seq + 1)
        if call is None:
            extends, ids = req.extends, req.prompt_ids
            parent = ep.calls.get(extends)
            context = parent.prompt_ids + parent.tokens if parent is not None and parent.done else None
            if context is not None and ids[: len(context)] == context and len(ids) > len(context):
                ids = ids[len(context) :]
            else:
                extends = -1
            self.events.append(
                req.episode_id,
                "call",
                {
                    "call": req.call,
                    "extends": extends,
                    "prompt_ids": ids,
                    "digest": req.digest,
                    "sampling": params.to_dict(),
                    "messages": req.messages,
                },
                self.engine.version,
            )
        else:
            live.tokens = list(call.tokens)
            takeover = takeover_from or (call.worker if call.worker != self.worker_id else None)
            self.events.append(
                req.episode_id,
                "resumed",
                {"call": req.call, "num_tokens": len(call.tokens), **({"takeover_from": takeover} if takeover else {})},
                self.engine.version,
            )
            self.stats["call_resumes"] += 1
        self.live[live.request_id] = live
        self._check(self.events.flush([req.episode_id]))
        if live.request_id in self.live:
            self._generate(live)

    def _open_log(self, episode_id: str, next_seq: int) -> None:
        if self.open_eps.get(episode_id, 0) == 0:
            self.events.open(episode_id, next_seq)
        self.open_eps[episode_id] = self.open_eps.get(episode_id, 0) + 1

    def _generate(self, live: LiveCall) -> None:
        if self.paused:
            live.paused = True
            return
        context = live.req.prompt_ids + live.tokens
        # logged up to a stop string's last token by a worker that died before its call_done
        hit = self._stop_at(live, live.tokens, len(live.tokens) - 1)
        if hit is not None:
            return self._done(live, "stop", hit[1])
        if live.remaining <= 0 or len(context) >= self.engine.max_model_len:
            return self._done(live, "length")
        try:
            self.engine.add_request(
                live.request_id,
                context,
                live.params,
                min(live.remaining, self.engine.max_model_len - len(context)),
                start_index=len(live.tokens),
            )
        except EngineError as exc:
            self.log.error("call refused by the engine", call=live.request_id, error=str(exc))
            return self._done(live, "length")

    def _decode(self, ids: list[int]) -> str:
        # the text the answer is made of (the gateway decodes the same way)
        return self.tok.decode(ids, skip_special_tokens=True)

    def _stop_at(self, live: LiveCall, ids: list[int], start: int) -> tuple[int, str] | None:
        return first_stop(self._decode, ids, start, live.stops) if live.stops and ids else None

    def on_chunk(self, chunk: Chunk) -> None:
        live = self.live.get(chunk.request_id)
        if live is None:
            return
        ids, logprobs, routes = chunk.token_ids, chunk.logprobs, chunk.routes
        # the whole completion (logged prefix + new): a stop string may straddle an abort
        hit = self._stop_at(live, live.tokens + ids, len(live.tokens)) if live.stops and ids else None
        if hit is not None:
            # nothing after the token that completes the string is logged
            keep = hit[0] + 1 - len(live.tokens)
            ids, logprobs = ids[:keep], logprobs[:keep]
            routes = None if routes is None else routes[:keep]
        if ids:
            self.events.append_tokens(live.req.episode_id, ids, logprobs, chunk.version, routes, call=live.req.call)
            live.tokens += ids
            self.stats["call_tokens"] += len(ids)
        if hit is not None:
            if chunk.finish_reason is None:
                self.engine.abort(chunk.request_id)
            return self._done(live, "stop", hit[1])
        if chunk.finish_reason is not None and chunk.finish_reason != "abort":
            reason = "stop" if chunk.finish_reason == "stop" else "length"
            self._done(live, reason)

    def _done(self, live: LiveCall, reason: str, stop: str | None = None) -> None:
        eid = live.req.episode_id
        self.events.append(
            eid,
            "call_done",
            {
                "call": live.req.call,
                "reason": reason,
                "num_tokens": len(live.tokens),
                **({"stop": stop} if stop is not None else {}),
            },
            self.engine.version,
        )
        errors = self.events.flush([eid])
        if live.request_id not in self.live:
            return
        self._forget(live)
        if not errors:
            self.client.xack(self.keys.calls, GROUP, live.req.entry_id)
            self.stats["calls"] += 1
        self._check(errors)

    def _forget(self, live: LiveCall) -> None:
        self.live.pop(live.request_id, None)
        eid = live.req.episode_id
        self.open_eps[eid] -= 1
        if self.open_eps[eid] <= 0:
            del self.open_eps[eid]
            self.events.close(eid)

    # --- pause / resume (the worker calls these with the rest of its requests)
    def on_abort(self, reason: str) -> None:
        """After the engine's abort_all (whose chunks went to ``on_chunk``): record where each call stopped."""
        for live in self.live.values():
            if not live.paused:
                live.paused = True
                self.events.append(
                    live.req.episode_id,
                    "aborted",
                    {"call": live.req.call, "reason": reason, "num_tokens": len(live.tokens)},
                    self.engine.version,
                )
        self.paused = True
        self._check(self.events.flush())

    def resume(self) -> None:
        """Continue every aborted call from what its stream says."""
        self.paused = False
        resumed = []
        for live in list(self.live.values()):
            if not live.paused:
                continue
            call = fold(self.events.read(live.req.episode_id)).calls.get(live.req.call)
            if call is not None and call.tokens != live.tokens:
                self.log.error("stream and memory disagree; continuing from the stream", call=live.request_id)
                live.tokens = list(call.tokens)
            self.events.append(
                live.req.episode_id,
                "resumed",
                {"call": live.req.call, "num_tokens": len(live.tokens)},
                self.engine.version,
            )
            self.stats["call_resumes"] += 1
            live.paused = False
            resumed.append(live)
        self._check(self.events.flush())
        for live in resumed:
            if live.request_id in self.live:
                self._generate(live)

    # --- failures
    def _check(self, errors: dict) -> None:
        for episode_id, exc in errors.items():
            if not isinstance(exc, Fenced):
                raise exc
            self.log.warning(
                "lost a call's episode to another writer; dropping its calls", episode=episode_id, reason=str(exc)
            )
            for live in [l for l in self.live.values() if l.req.episode_id == episode_id]:
                self.engine.abort(live.request_id)
                self.live.pop(live.request_id, None)
            self.open_eps.pop(episode_id, None)

    def _dead_letter(self, entry_id, reason: str) -> None:
        entry_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        self.log.error("bad call request sent to dead letters", entry=entry_id, reason=reason)
        # once
        dead_letters.send(self.client, self.keys, self.keys.calls, entry_id, reason, self.worker_id)

    def _take_over(self) -> None:
        room = self.cfg.max_calls_in_flight - len(self.live)
        if room <= 0:
            return
        min_idle = int(self.cfg.heartbeat_ttl * 1000)
        pending = self.client.xpending_range(self.keys.calls, GROUP, min="-", max="+", count=100)
        held = {l.req.entry_id for l in self.live.values()}
        orphans = [
            p["message_id"]
            for p in pending
            if p["consumer"].decode() == self.worker_id and p["message_id"].decode() not in held
        ]
        for entry_id, fields in (
            self.client.xclaim(self.keys.calls, GROUP, self.worker_id, 0, orphans[:room]) if orphans else []
        ):
            if fields:
                self._open(entry_id, fields)
        dead: dict[str, list] = {}
        for p in pending:
            owner = p["consumer"].decode()
            if owner != self.worker_id and p["time_since_delivered"] >= min_idle:
                dead.setdefault(owner, []).append(p["message_id"])
        for owner, ids in dead.items():
            if self.client.exists(self.keys.alive("rollout", owner)):
                self._missing_since.pop(owner, None)
                continue
            if time.monotonic() - self._missing_since.setdefault(owner, time.monotonic()) < self.cfg.heartbeat_ttl:
                continue
            for entry_id, fields in self.client.xclaim(self.keys.calls, GROUP, self.worker_id, min_idle, ids[:room]):
                if fields:
                    self.stats["call_takeovers"] += 1
                    self.log.info("call taken over", entry=entry_id.decode(), takeover_from=owner)
                    self._open(entry_id, fields, takeover_from=owner)


def _id_key(entry_id: str) -> tuple[int, int]:
    if entry_id == "$":
        return (-1, -1)
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
