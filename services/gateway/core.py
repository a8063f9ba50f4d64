"""The gateway's work behind HTTP: validate a request, find or make its call
in the episode, hand it to the rollout workers, and follow the episode stream
until the call is done.

Stateless: everything it knows it reads from Redis on each request. A retry
(same episode, same request digest) finds the call already made, through the
episode's call index, and is answered from the stream without generating.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from services.gateway import schema, toolparse
from services.gateway.asks import Ask, Asks
from services.gateway.chat import Renderer, RenderError, canonical, digest, find_parent, with_system_hint
from services.gateway.errors import GatewayError
from services.gateway.fields import check as check_fields
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import Event, decode
from shared.protocol.episode.fold import TRANSFORM, Call, Episode, fold
from shared.protocol.episode.sampling import MAX_STOP_CHARS, MAX_STOPS, SEED_RANGE, stable_seed
from shared.protocol.keys import Keys
from shared.protocol.streams.calls import CallRequest, Requester

ROLES = ("system", "developer", "user", "assistant", "tool")


def same_transform(a: dict, b: dict) -> bool:
    """Whether two calls sample under the same transform (one row trains under one)."""
    return all(float(a.get(k) or 0) == float(b.get(k) or 0) for k in TRANSFORM)


# choices one chat call may ask for (n): each is a call of its own, sampled at once
MAX_CHOICES = 16


@dataclass
class Made:
    """The calls a request made or found (one per choice, in choice order), and the episode's events as read
    before (``follow`` reads on from them)."""

    calls: list[int]
    seen: list[Event]


@dataclass
class Prepared:
    episode_id: str
    # the first choice's call; ``calls`` has every choice's, in choice order
    call: int
    prompt_len: int
    logprobs: bool
    stream: bool
    include_usage: bool
    model: str
    # return_token_ids: prompt_token_ids and token_ids in the answer (vLLM's names)
    token_ids: bool = False
    calls: list[int] | None = None
    # what shapes the streamed text: the client's stop strings (held back while they may be starting), the
    # prefill the answer is parsed after, whether tool calls are parsed (tool_choice none: not)
    stops: list[str] = field(default_factory=list)
    prefill: str = ""
    parse_tools: bool = True
    # the episode's events as the request read them: following the call reads on from the last (``follow``)
    seen: list[Event] | None = None

    def __post_init__(self):
        if self.calls is None:
            self.calls = [self.call]


def _in_range(name: str, value: float | None, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    """A parsed number (finite: the schema said so) within its range, or its default when the body had none."""
    if value is None:
        return default
    if value < lo or value > hi or (lo_open and value == lo):
        raise GatewayError(
            400, f"{name}: expected {'>' if lo_open else '>='} {lo:g} and <= {hi:g}, got {value}", name, "invalid_value"
        )
    return float(value)


class Gateway:
    def __init__(self, cfg, client, tokenizer, max_model_len: int, model_names: list[str], log):
        self.cfg, self.client, self.tok, self.log = cfg, client, tokenizer, log
        self.keys = Keys(cfg.run)
        self.renderer = Renderer(tokenizer)
        self.requester = Requester(client, self.keys)
        self.asks = Asks(client, self.keys)
        self.max_model_len = max_model_len
        self.model_names = model_names
        # set when the process is told to stop: calls held open answer at once
        self.stopping = threading.Event()

    # --- request checks
    def _episode(self, episode_id: str) -> Episode:
        return self._fold(episode_id, self.client.xrange(self.keys.episode(episode_id)))

    def _read(self, episode_id: str, digests: list[str], ask: Ask) -> tuple[Episode, list[tuple[str, int | None]]]:
        """The episode, and the identity of each digest's ask with the index of the call requested under it (if
        any; ``Asks.identity``): in one round trip. (An ask to an episode with no stream is counted all the same:
        nothing asks for that episode's calls before its runner starts it.)"""
        pipe = self.client.pipeline(transaction=False)
        pipe.xrange(self.keys.episode(episode_id))
        reads = [self.asks.ask_on(pipe, episode_id, dg, ask) for dg in digests]
        entries, *replies = pipe.execute()
        return self._fold(episode_id, entries), [read(reply) for read, reply in zip(reads, replies)]

    def _fold(self, episode_id: str, entries) -> Episode:
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

    def _common(self, req: schema.Chat | schema.Completion) -> dict:
        """The call's sampling from a parsed chat or completions request."""
        if req.max_completion_tokens is not None:
            max_tokens = ("max_completion_tokens", req.max_completion_tokens)
        else:
            max_tokens = ("max_tokens", req.max_tokens)
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        return self.sampling(
            model=req.model,
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=max_tokens,
            stop=("stop", stops),
            seed=req.seed,
        )

    def choices(self, n: int | None, name: str = "n") -> int:
        if n is None:
            return 1
        if not 1 <= n <= MAX_CHOICES:
            raise GatewayError(400, f"{name}: expected 1 to {MAX_CHOICES} choices, got {n!r}", name, "invalid_value")
        return n

    def sampling(
        self,
        *,
        model: str | None,
        temperature: float | None,
        top_p: float | None,
        max_tokens: tuple[str, int | None],
        stop: tuple[str, list[str]],
        seed: int | None = None,
    ) -> dict:
        """A call's sampling from any API's fields (each a parsed value or None; ``max_tokens`` and ``stop`` come
        with the name the API gives them, for the error): only ranges and meanings are left to check.

        A stop string that is one special token (``<|im_end|>``) stops as that token id (special tokens are not in
        the decoded text); any other is matched on the decoded completion by the rollout worker (``stop``)."""
        if model is not None and model not in self.model_names:
            raise GatewayError(
                404,
                f"model: unknown model {model!r}; this gateway serves {', '.join(map(repr, self.model_names))}",
                "model",
                "model_not_found",
            )
        name, limit = max_tokens
        if limit is None:
            limit = self.cfg.max_tokens
        if limit < 1:
            raise GatewayError(400, f"{name}: expected an integer >= 1, got {limit}", name, "invalid_value")
        stop_name, stops = stop
        if len(stops) > MAX_STOPS:
            raise GatewayError(
                400, f"{stop_name}: expected a string or a list of at most {MAX_STOPS} strings", stop_name
            )
        stop_ids, strings = list(self.renderer.stop_ids), []
        special = set(self.tok.all_special_ids)
        for s in stops:
            if not s or len(s) > MAX_STOP_CHARS:
                raise GatewayError(
                    400,
                    f"{stop_name}: expected non-empty strings of at most {MAX_STOP_CHARS} characters, got "
                    f"{json.dumps(s)[:80]}",
                    stop_name,
                    "invalid_value",
                )
            ids = self.tok.encode(s, add_special_tokens=False)
            if len(ids) == 1 and ids[0] in special:
                stop_ids.append(ids[0])
            elif special.intersection(ids):
                raise GatewayError(
                    400,
                    f"{stop_name}: {s!r} mixes special tokens and text; a stop string is matched on the text "
                    f"without special tokens (a special token alone stops as that token)",
                    stop_name,
                    "invalid_value",
                )
            elif s not in strings:
                strings.append(s)
        out = {
            "temperature": _in_range("temperature", temperature, self.cfg.temperature, 0.0, 2.0),
            "top_p": _in_range("top_p", top_p, self.cfg.top_p, 0.0, 1.0, lo_open=True),
            "top_k": self.cfg.top_k,
            "max_tokens": limit,
            "stop_token_ids": sorted(set(stop_ids)),
        }
        # absent when unused: a call's digest (its identity for retries and reruns) is as it was
        if strings:
            out["stop"] = strings
        if seed is not None:
            if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
                raise GatewayError(400, f"seed: expected a 64-bit integer, got {seed}", "seed", "invalid_value")
            out["seed"] = seed
        return out

    def tool_choice(self, value: Any, tools: list | None, name: str = "tool_choice") -> Any:
        """The tool choice a call logs (None for auto) for an OpenAI-style ``tool_choice``. The policy cannot be
        constrained by a grammar here: ``none`` answers its text unparsed (no tool calls); ``required`` and a named
        function put the template's tool-call opening (``<tool_call>`` and, named, ``{"name": ..., "arguments": ``)
        after the generation prompt as prompt tokens (``prefill``), so the completion is that call's rest."""
        if value is None or value == "auto":
            return None
        if value == "none":
            return "none"
        names = [(t.get("function") or {}).get("name") for t in tools or []]
        fn = None
        if value != "required":
            function = value.get("function") if isinstance(value, dict) else None
            fn = function.get("name") if isinstance(function, dict) else None
            if not (isinstance(value, dict) and value.get("type") == "function" and isinstance(fn, str)):
                raise GatewayError(
                    400,
                    f"{name}: expected 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                    f'{{"name": ...}}}}, got {json.dumps(value, default=str)[:80]}',
                    name,
                    "invalid_value",
                )
            if fn not in names:
                raise GatewayError(
                    400,
                    f"{name}.function.name: {fn!r} is not one of the request's tools "
                    f"({', '.join(map(repr, names)) or 'none sent'})",
                    f"{name}.function.name",
                    "invalid_value",
                )
        if not names:
            raise GatewayError(400, f"{name}: {json.dumps(value)[:80]} needs tools; the request has none", name)
        if self.renderer.tool_call_opening(fn) is None:
            raise GatewayError(
                400,
                f"{name}: {json.dumps(value)[:80]} cannot be honoured: a tool call is forced by prefilling its "
                f"opening, and the model's chat template does not write Hermes-style {toolparse.OPEN} blocks",
                name,
                "unsupported_value",
            )
        return value if fn is None else {"type": "function", "function": {"name": fn}}

    def prefill(self, tool_choice: Any) -> str:
        """The text a call's prompt ends with after the generation prompt: a forced tool call's opening."""
        if tool_choice in (None, "none"):
            return ""
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        return self.renderer.tool_call_opening(name) or ""

    @staticmethod
    def format_hint(fmt: dict | None, name: str = "response_format") -> str | None:
        """The system line a ``response_format`` puts in the prompt (None for text): a hint the policy may ignore,
        never enforced (no constrained decoding)."""
        kind = (fmt or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return "Answer with a single JSON object and nothing else."
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise GatewayError(
                    400,
                    f"{name}.json_schema: expected an object with a 'schema' object, got "
                    f"{json.dumps(spec, default=str)[:80]}",
                    f"{name}.json_schema",
                    "invalid_value",
                )
            schema_text = json.dumps(spec.get("schema", {}), sort_keys=True)
            return f"Answer with a single JSON object and nothing else, following this JSON schema: {schema_text}"
        raise GatewayError(
            400,
            f"{name}.type: expected 'text', 'json_object' or 'json_schema', got {json.dumps(kind, default=str)[:80]}",
            f"{name}.type",
            "invalid_value",
        )

    def _messages(self, req: schema.Chat, body: dict) -> tuple[list[dict], list | None]:
        if not req.messages:
            raise GatewayError(400, "messages: expected a non-empty array of messages", "messages")
        for i, m in enumerate(req.messages):
            if m.role not in ROLES:
                raise GatewayError(
                    400,
                    f"messages[{i}].role: expected one of {', '.join(ROLES)}, got {json.dumps(m.role)}",
                    f"messages[{i}].role",
                )
        # as sent, keys in the client's order (the parsed models put declared fields first): the chat template
        # renders the tools as JSON, and a model learns the layout it was trained on
        return list(body["messages"]), list(body["tools"]) if req.tools else None

    def _prepared(
        self,
        episode_id: str,
        made: Made,
        req: schema.Chat | schema.Completion,
        logprobs: bool,
        sampling: dict,
        prefill: str = "",
        parse_tools: bool = True,
    ) -> Prepared:
        return Prepared(
            episode_id,
            made.calls[0],
            0,
            logprobs,
            bool(req.stream),
            bool((req.stream_options or {}).get("include_usage")),
            req.model or self.model_names[0],
            bool(req.return_token_ids),
            made.calls,
            list(sampling.get("stop") or ()),
            prefill,
            parse_tools,
            made.seen,
        )

    # --- making the call
    def prepare_chat(self, episode_id: str, body: Any, headers=None) -> Prepared:
        req = schema.parse(body, schema.Chat)
        check_fields(body)
        sampling = self._common(req)
        n = self.choices(req.n)
        messages, tools = self._messages(req, body)
        hint = self.format_hint(req.response_format)
        if hint is not None:
            messages = with_system_hint(messages, hint)
        choice = self.tool_choice(req.tool_choice, tools)
        if req.parallel_tool_calls is False and tools and choice != "none":
            # one tool call at most: the call ends at the first call's closing tag, kept in the answer's parse
            sampling = {**sampling, "stop_kept": [toolparse.CLOSE]}
        made = self.chat_calls(episode_id, messages, tools, sampling, Ask.of(headers), n, choice)
        return self._prepared(
            episode_id, made, req, bool(req.logprobs), sampling, self.prefill(choice), choice != "none"
        )

    def chat_calls(
        self,
        episode_id: str,
        messages: list[dict],
        tools: list | None,
        sampling: dict,
        ask: Ask,
        n: int = 1,
        tool_choice: Any = None,
    ) -> Made:
        """The calls (one per choice) that answer chat ``messages`` (OpenAI chat messages and tools, as any API's
        adapter renders them), made now or found made before. ``tool_choice``: what ``tool_choice()`` returned
        (None: auto); a forced tool call's prefill goes into the prompt and the call's log."""
        prefill = self.prefill(tool_choice)
        payload = {"messages": [canonical(m) for m in messages], "tools": tools, "sampling": sampling}
        # only when set: the digest of an auto call is as it always was
        if tool_choice is not None:
            payload["tool_choice"] = tool_choice
        dg = digest("chat", payload)
        ep, identities = self._read(episode_id, [self._choice_digest(dg, j) for j in range(n)], ask)
        forced = self.renderer.encode(prefill) if prefill else []

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
                    return parent.index, parent.prompt_ids + parent.tokens + bridge + forced
                self.log.warning("template does not append the new messages; forking", episode=episode_id)
            return -1, self.renderer.full(messages, tools) + forced

        record: dict = {"messages": messages, "tools": tools}
        if tool_choice is not None:
            record["tool_choice"] = tool_choice
        if prefill:
            record["prefill"] = prefill
        logged = json.dumps(record)
        # a choice after the first is its own ask: its own call, its own chain, its own training row
        calls = [self._call(ep, identities[j], build, self._choice_sampling(sampling, j), logged) for j in range(n)]
        return Made(calls, ep.events)

    @staticmethod
    def _choice_sampling(sampling: dict, choice: int) -> dict:
        """A choice's sampling: a client's seed is the first choice's; each other choice samples with its own
        seed made from it (the same seed for every choice would draw the same answer n times)."""
        if choice == 0 or "seed" not in sampling:
            return sampling
        return {**sampling, "seed": stable_seed(sampling["seed"], choice)}

    @staticmethod
    def _choice_digest(dg: str, choice: int) -> str:
        return dg if choice == 0 else f"{dg}/{choice}"

    def prepare_completion(self, episode_id: str, body: Any, headers=None) -> Prepared:
        req = schema.parse(body, schema.Completion)
        check_fields(body)
        sampling = self._common(req)
        n = self.choices(req.n)
        top = req.logprobs
        if top is not None and not isinstance(top, bool) and top != 0:
            raise GatewayError(
                400,
                f"logprobs: the episode stream keeps the sampled token's log-prob only; expected "
                f"0 or true, got {json.dumps(top)}",
                "logprobs",
                "invalid_value",
            )
        prompt = req.prompt
        if isinstance(prompt, str) and prompt:
            ids = self.tok.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and prompt and all(0 <= i < len(self.tok) for i in prompt):
            ids = list(prompt)
        else:
            raise GatewayError(
                400, f"prompt: expected a non-empty string or array of token ids below {len(self.tok)}", "prompt"
            )
        dg = digest("completion", {"prompt": ids, "sampling": sampling})
        ep, identities = self._read(episode_id, [self._choice_digest(dg, j) for j in range(n)], Ask.of(headers))

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

        logged = json.dumps({"prompt": prompt if isinstance(prompt, str) else None})
        calls = [self._call(ep, identities[j], build, self._choice_sampling(sampling, j), logged) for j in range(n)]
        return self._prepared(episode_id, Made(calls, ep.events), req, top is not None and top is not False, sampling)

    def _call(self, ep: Episode, identity: tuple[str, int | None], build, sampling: dict, messages: str) -> int:
        """The call whose identity is ``identity`` (with the index of the call the episode's call index has under
        it, if any): found in the episode (made before: answered from the stream), or requested of the rollout
        workers now."""
        dg, known = identity
        for call in ep.calls.values():
            if call.digest == dg:
                # made before: answered from the stream
                return call.index
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
    def follow(
        self, episode_id: str, index: int, timeout: float, seen: list[Event] | None = None
    ) -> Iterator[tuple[str, Any]]:
        """Yields ("tokens", completion so far) as it grows, ("wait", None) every few quiet seconds, and finally
        ("done", Call), ("timeout", None), or ("stopping", None) within a second of ``stopping`` being set (the
        process is stopping: the client retries against a gateway that runs, answered from the stream).

        ``seen``: the episode's events from its start as the request read them (``Made.seen``); the stream is
        read on after the last (append-only: nothing is missed), and the call is folded from what was read, each
        entry decoded once. None: the stream is read from its start."""
        key = self.keys.episode(episode_id)
        events = list(seen) if seen is not None else [decode(e, f) for e, f in self.client.xrange(key)]
        cursor = events[-1].entry_id if events else "0-0"
        tokens: list[int] = []
        deadline = time.monotonic() + timeout
        batch = events
        quiet_since = time.monotonic()
        while True:
            grew, done = False, False
            for ev in batch:
                if ev.data.get("call") == index and ev.kind == "tokens":
                    tokens += ev.data["ids"]
                    grew = True
                elif ev.data.get("call") == index and ev.kind == "call_done":
                    done = True
                elif ev.kind in ("finished", "failed"):
                    done = True
            if done:
                # the events read so far end at the call's end: its fold is the stream's
                call = fold(events).calls.get(index)
                if call is None or not call.done:
                    raise GatewayError(
                        409, f"episode {episode_id!r} ended before call {index} was answered", None, "episode_ended"
                    )
                self.asks.answered(episode_id, index)
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
            batch = [decode(e, f) for _, es in reply or [] for e, f in es]
            if batch:
                events += batch
                cursor, quiet_since = batch[-1].entry_id, time.monotonic()
            elif time.monotonic() - quiet_since >= 5.0:
                quiet_since = time.monotonic()
                yield "wait", None

    def wait_done(self, episode_id: str, index: int, seen: list[Event] | None = None) -> Call:
        """The complete call, or GatewayError 503 (retry) when it is held past ``gateway_timeout`` or the
        process stops: the client's retry waits on the same call, answered from its stream. ``seen``: as
        ``follow``'s."""
        for kind, value in self.follow(episode_id, index, self.cfg.gateway_timeout, seen):
            if kind == "timeout":
                raise GatewayError(
                    503,
                    f"call {index} of episode {episode_id!r} is still generating "
                    f"(a weight sync holds it); retry: the retry waits on the same call",
                    None,
                    "still_generating",
                    {"x-should-retry": "true", "retry-after": "1"},
                )
            if kind == "stopping":
                raise GatewayError(
                    503,
                    f"the gateway is stopping (the run ends, or it restarts); retry: call "
                    f"{index} of episode {episode_id!r} is answered from its stream",
                    None,
                    "gateway_stopping",
                    {"x-should-retry": "true", "retry-after": "1"},
                )
            if kind == "done":
                return value
        raise AssertionError("follow ends with done, timeout or stopping")

    def answer(self, call: Call) -> tuple[dict, str, list[str]]:
        """(assistant message, finish_reason, parse problems) for a complete call."""
        message, problems = self.renderer.answer(call)
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
