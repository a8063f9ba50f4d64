"""The gateway's work behind HTTP: validate a request, find or make its call
in the episode, hand it to the rollout workers, and follow the episode stream
until the call is done.

Stateless: everything it knows it reads from Redis on each request. A retry
(same episode, same request digest) finds the call already made, through the
episode's call index, and is answered from the stream without generating.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from services.gateway import schema
from services.gateway.chat import Renderer, RenderError, canonical, digest, find_parent
from services.gateway.errors import GatewayError
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import decode
from shared.protocol.episode.fold import TRANSFORM, Call, Episode, fold
from shared.protocol.keys import Keys
from shared.protocol.streams.calls import CallRequest, Requester

ROLES = ("system", "developer", "user", "assistant", "tool")


def same_transform(a: dict, b: dict) -> bool:
    """Whether two calls sample under the same transform (one row trains under one)."""
    return all(float(a.get(k) or 0) == float(b.get(k) or 0) for k in TRANSFORM)


@dataclass
class Prepared:
    episode_id: str
    call: int
    prompt_len: int
    logprobs: bool
    stream: bool
    include_usage: bool
    model: str
    # return_token_ids: prompt_token_ids and token_ids in the answer (vLLM's names)
    token_ids: bool = False


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GatewayError(400, f"{name}: expected a finite number, got {json.dumps(value)}", name, "invalid_type")
    if value < lo or value > hi or (lo_open and value == lo):
        raise GatewayError(
            400, f"{name}: expected {'>' if lo_open else '>='} {lo:g} and <= {hi:g}, got {value}", name, "invalid_value"
        )
    return float(value)


def _named_function(item) -> bool:
    """A tool or a tool call: an object whose ``function`` is an object with a string ``name``."""
    return (
        isinstance(item, dict)
        and isinstance(item.get("function"), dict)
        and isinstance(item["function"].get("name"), str)
    )


class Gateway:
    def __init__(self, cfg, client, tokenizer, max_model_len: int, model_names: list[str], log):
        self.cfg, self.client, self.tok, self.log = cfg, client, tokenizer, log
        self.keys = Keys(cfg.run)
        self.renderer = Renderer(tokenizer)
        self.requester = Requester(client, self.keys)
        self.max_model_len = max_model_len
        self.model_names = model_names
        # set when the process is told to stop: calls held open answer at once
        self.stopping = threading.Event()

    # --- request checks
    def _episode(self, episode_id: str) -> Episode:
        entries = self.client.xrange(self.keys.episode(episode_id))
        if not entries:
            raise GatewayError(
                404,
                f"unknown episode {episode_id!r}: no stream {self.keys.episode(episode_id)} "
                f"(episodes are started by the agent runner)",
                None,
                "episode_not_found",
            )
        try:
            ep = fold(entries)
        except EventError as exc:
            raise GatewayError(409, f"episode {episode_id!r}: stream unreadable ({exc})", None, "episode_unreadable")
        return ep

    def _common(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise GatewayError(400, "request body: expected a JSON object", None, "invalid_type")
        model = body.get("model")
        if model is not None and model not in self.model_names:
            raise GatewayError(
                404,
                f"model: unknown model {model!r}; this gateway serves {', '.join(map(repr, self.model_names))}",
                "model",
                "model_not_found",
            )
        if body.get("n", 1) != 1:
            raise GatewayError(400, f"n: only 1 choice per call is supported, got {body.get('n')!r}", "n")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if max_tokens is None:
            max_tokens = self.cfg.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise GatewayError(
                400, f"{name}: expected an integer >= 1, got {json.dumps(max_tokens)}", name, "invalid_value"
            )
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
            raise GatewayError(400, "stop: expected a string or a list of at most 4 strings", "stop")
        stop_ids = list(self.renderer.stop_ids)
        for s in stops:
            ids = self.tok.encode(s, add_special_tokens=False)
            if len(ids) != 1:
                raise GatewayError(
                    400,
                    f"stop: {s!r} is {len(ids)} tokens; only stop strings of one token are supported",
                    "stop",
                    "invalid_value",
                )
            stop_ids.append(ids[0])
        for flag in ("stream", "return_token_ids"):
            if not isinstance(body.get(flag, False), bool):
                raise GatewayError(400, f"{flag}: expected true or false, got {json.dumps(body.get(flag))}", flag)
        return {
            "temperature": _number(body, "temperature", self.cfg.temperature, 0.0, 2.0),
            "top_p": _number(body, "top_p", self.cfg.top_p, 0.0, 1.0, lo_open=True),
            "top_k": self.cfg.top_k,
            "max_tokens": max_tokens,
            "stop_token_ids": sorted(set(stop_ids)),
        }

    def _messages(self, body: dict) -> tuple[list[dict], list | None]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise GatewayError(400, "messages: expected a non-empty array of messages", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise GatewayError(
                    400,
                    f"messages[{i}].role: expected one of {', '.join(ROLES)}, got "
                    f"{json.dumps(m.get('role') if isinstance(m, dict) else m)}",
                    f"messages[{i}].role",
                )
            calls = m.get("tool_calls")
            if calls is not None and not (isinstance(calls, list) and all(_named_function(c) for c in calls)):
                raise GatewayError(
                    400,
                    f"messages[{i}].tool_calls: expected an array of objects with function.name",
                    f"messages[{i}].tool_calls",
                )
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(_named_function(t) for t in tools)):
            raise GatewayError(400, "tools: expected an array of {type: function, function: {name, ...}}", "tools")
        return messages, tools or None

    # --- making the call
    def prepare_chat(self, episode_id: str, body: Any) -> Prepared:
        schema.check(body, schema.Chat)
        sampling = self._common(body)
        if not isinstance(body.get("logprobs", False), bool):
            raise GatewayError(
                400, f"logprobs: expected true or false, got {json.dumps(body.get('logprobs'))}", "logprobs"
            )
        messages, tools = self._messages(body)
        dg = digest("chat", {"messages": [canonical(m) for m in messages], "tools": tools, "sampling": sampling})
        ep = self._episode(episode_id)

        def build() -> tuple[int, list[int]]:
            found = find_parent(ep.calls, messages, tools, self.renderer)
            if found is not None and not same_transform(found[0].sampling, sampling):
                self.log.info(
                    "call changes temperature/top_k/top_p; a new chain (a row trains under one transform)",
                    episode=episode_id,
                )
                found = None
            if found is not None:
                parent, new = found
                ended = bool(parent.tokens) and parent.tokens[-1] in self.renderer.stop_ids
                bridge = self.renderer.bridge(ended, new, tools)
                if bridge is not None:
                    return parent.index, parent.prompt_ids + parent.tokens + bridge
                self.log.warning("template does not append the new messages; forking", episode=episode_id)
            return -1, self.renderer.full(messages, tools)

        index = self._call(ep, dg, build, sampling, json.dumps({"messages": messages, "tools": tools}))
        return Prepared(
            episode_id,
            index,
            0,
            bool(body.get("logprobs")),
            bool(body.get("stream")),
            bool((body.get("stream_options") or {}).get("include_usage")),
            body.get("model") or self.model_names[0],
            bool(body.get("return_token_ids")),
        )

    def prepare_completion(self, episode_id: str, body: Any) -> Prepared:
        schema.check(body, schema.Completion)
        sampling = self._common(body)
        top = body.get("logprobs")
        if top is not None and not isinstance(top, bool) and top != 0:
            raise GatewayError(
                400,
                f"logprobs: the episode stream keeps the sampled token's log-prob only; expected "
                f"0 or true, got {json.dumps(top)}",
                "logprobs",
                "invalid_value",
            )
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            ids = self.tok.encode(prompt, add_special_tokens=False)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(self.tok) for i in prompt)
        ):
            ids = list(prompt)
        else:
            raise GatewayError(
                400, f"prompt: expected a non-empty string or array of token ids below {len(self.tok)}", "prompt"
            )
        dg = digest("completion", {"prompt": ids, "sampling": sampling})
        ep = self._episode(episode_id)

        def build() -> tuple[int, list[int]]:
            for call in sorted(ep.calls.values(), key=lambda c: c.index, reverse=True):
                context = call.prompt_ids + call.tokens
                if (
                    call.done
                    and len(ids) > len(context)
                    and ids[: len(context)] == context
                    and same_transform(call.sampling, sampling)
                ):
                    return call.index, ids
            return -1, ids

        index = self._call(ep, dg, build, sampling, json.dumps({"prompt": prompt if isinstance(prompt, str) else None}))
        return Prepared(
            episode_id,
            index,
            0,
            top is not None and top is not False,
            bool(body.get("stream")),
            bool((body.get("stream_options") or {}).get("include_usage")),
            body.get("model") or self.model_names[0],
            bool(body.get("return_token_ids")),
        )

    def _call(self, ep: Episode, dg: str, build, sampling: dict, messages: str) -> int:
        for call in ep.calls.values():
            if call.digest == dg:
                # made before: answered from the stream
                return call.index
        known = self.requester.lookup(ep.episode_id, dg)
        if known is not None:
            # requested before, not yet opened by a worker: wait for it
            return known
        if ep.done:
            raise GatewayError(
                409, f"episode {ep.episode_id!r} has ended ({ep.status}); it takes no more calls", None, "episode_ended"
            )
        try:
            extends, prompt = build()
        except RenderError as exc:
            raise GatewayError(400, f"messages: {exc}", "messages", "invalid_value") from None
        if len(prompt) + 1 > self.max_model_len:
            raise GatewayError(
                400,
                f"messages: the prompt is {len(prompt)} tokens; the model's context is "
                f"{self.max_model_len} tokens (prompt + completion)",
                "messages",
                "context_length_exceeded",
            )
        sampling = {**sampling, "max_tokens": min(sampling["max_tokens"], self.max_model_len - len(prompt))}
        index, new = self.requester.request(CallRequest(ep.episode_id, dg, extends, prompt, sampling, messages))
        self.log.info(
            "call requested" if new else "call matched a request",
            episode=ep.episode_id,
            call=index,
            extends=extends,
            prompt_tokens=len(prompt),
        )
        return index

    # --- following the stream
    def follow(self, episode_id: str, index: int, timeout: float) -> Iterator[tuple[str, Any]]:
        """Yields ("tokens", completion so far) as it grows, ("wait", None) every few quiet seconds, and finally
        ("done", Call), ("timeout", None), or ("stopping", None) within a second of ``stopping`` being set (the
        process is stopping: the client retries against a gateway that runs, answered from the stream)."""
        key = self.keys.episode(episode_id)
        entries = self.client.xrange(key)
        cursor = entries[-1][0] if entries else "0-0"
        tokens: list[int] = []
        deadline = time.monotonic() + timeout
        batch = entries
        quiet_since = time.monotonic()
        while True:
            grew, done = False, False
            for entry_id, fields in batch:
                ev = decode(entry_id, fields)
                if ev.data.get("call") == index and ev.kind == "tokens":
                    tokens += ev.data["ids"]
                    grew = True
                elif ev.data.get("call") == index and ev.kind == "call_done":
                    done = True
                elif ev.kind in ("finished", "failed"):
                    done = True
            if done:
                call = fold(self.client.xrange(key)).calls.get(index)
                if call is None or not call.done:
                    raise GatewayError(
                        409, f"episode {episode_id!r} ended before call {index} was answered", None, "episode_ended"
                    )
                yield "done", call
                return
            if grew:
                yield "tokens", list(tokens)
            left = deadline - time.monotonic()
            if left <= 0:
                yield "timeout", None
                return
            if self.stopping.is_set():
                yield "stopping", None
                return
            # blocks of at most 1 s (a stop is seen within one); a quiet 5 s says "wait" (a keep-alive)
            reply = self.client.xread({key: cursor}, block=int(min(left, 1.0) * 1000), count=1000)
            batch = [e for _, es in reply or [] for e in es]
            if batch:
                cursor, quiet_since = batch[-1][0], time.monotonic()
            elif time.monotonic() - quiet_since >= 5.0:
                quiet_since = time.monotonic()
                yield "wait", None

    def answer(self, call: Call) -> tuple[dict, str, list[str]]:
        """(assistant message, finish_reason, parse problems) for a complete call."""
        message, problems = self.renderer.assistant(call.tokens, call.index)
        reason = "tool_calls" if message.get("tool_calls") else ("stop" if call.reason == "stop" else "length")
        return message, reason, problems

    def logprobs(self, call: Call) -> dict:
        return {
            "content": [
                {"token": self.tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(call.tokens, call.logprobs)
            ]
        }

    def completion_logprobs(self, call: Call) -> dict:
        """The completions API's (legacy) form: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens = [self.tok.decode([t]) for t in call.tokens]
        offsets, at = [], 0
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": list(call.logprobs), "top_logprobs": None, "text_offset": offsets}
