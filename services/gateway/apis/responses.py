"""OpenAI's Responses API (``POST /ep/<episode>/v1/responses``, what the OpenAI Agents SDK speaks by default) on the
gateway's chat calls.

A request's ``instructions`` and ``input`` items become OpenAI chat messages (a ``function_call`` item joins the
assistant message before it as a tool call, a ``function_call_output`` item is a ``tool`` message), its function
tools chat tools, and ``Gateway.chat_calls`` makes or finds the call: exact ids, forks, retries and crash recovery
are the chat path's. The answer is written back as ``output`` items (a ``message`` with ``output_text``, then one
``function_call`` item per tool call), whole or streamed as Responses events.

No store beyond the episode's log: a response's id names its call (``resp_<call index>_<tag>``, the tag tying it
to this run and episode), so ``previous_response_id`` is answered from the log: that call's logged messages, its
answer and the new input make the conversation, which extends that call exactly.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from services.gateway import schema, threads, toolparse
from services.gateway.asks import Ask
from services.gateway.core import Gateway
from services.gateway.errors import GatewayError
from services.gateway.limits import read_body
from shared.protocol.episode.fold import Call


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Tool(_Open):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Text(_Open):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class Item(_Open):
    """One ``input`` item: a message (``type`` "message", or no type and a ``role``), a ``function_call`` or a
    ``function_call_output``."""

    type: str | None = None
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    id: str | None = None


class Responses(_Open):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Tool] | None = None
    # read only to refuse what the gateway cannot honour (the chat path's rules)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    # the episode's log is the store: accepted either way
    store: bool | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    text: Text | None = None
    # accepted and ignored: they change nothing the policy samples
    metadata: dict[str, Any] | None = None
    user: str | None = None


# fields of the Responses API that would change the answer and that the gateway cannot do: refused when set
_REFUSED = {
    "conversation": "conversations are not stored; send the history as input items or use previous_response_id",
    "prompt": "stored prompt templates are not served",
    "background": "background responses are not served",
    "max_tool_calls": "nothing limits how many tool calls the model writes",
    "top_logprobs": "the episode stream keeps the sampled token's log-prob only",
    "context_management": "the context is never compacted: the episode trains on exactly what was sent",
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
_ID = re.compile(r"^resp_(\d{1,9})_([0-9a-f]{16})$")
_ITEM_ID = re.compile(r"^(?:msg|fc)_(\d{1,9})_")


def _bad(param: str, message: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, f"{param}: {message}", param, code)


def _at(prefix: str, body: Any, kind: type[BaseModel]):
    """``body`` (a part of the request at ``prefix``) as a ``kind``, each problem named from the request's root."""
    if not isinstance(body, dict):
        raise _bad(prefix, f"expected an object, got {json.dumps(body)[:80]}", "invalid_type")
    try:
        return schema.parse(body, kind)
    except GatewayError as exc:
        param = f"{prefix}.{exc.param}" if exc.param else prefix
        raise GatewayError(exc.status, f"{prefix}.{exc.message}", param, exc.code) from None


def _text(parts: str | list[dict] | None, param: str) -> str:
    """A content or output: a string, or text parts (``input_text``/``output_text``) joined."""
    if parts is None or isinstance(parts, str):
        return parts or ""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            raise _bad(
                f"{param}[{j}].type",
                f"expected one of {', '.join(TEXT_PARTS)} (the policy reads text only), got {json.dumps(kind)[:60]}",
                "unsupported_value",
            )
        if not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{j}].text", "expected a string", "invalid_type")
        out.append(part["text"])
    return "".join(out)


def response_tag(run: str, episode_id: str, index: int) -> str:
    return hashlib.sha256(f"response/{run}/{episode_id}/{index}".encode()).hexdigest()[:16]


def response_id(run: str, episode_id: str, index: int) -> str:
    return f"resp_{index}_{response_tag(run, episode_id, index)}"


def messages_of(items: list[Any]) -> list[dict]:
    """``input`` items as OpenAI chat messages. A ``function_call`` joins the assistant message just before it (the
    one turn the gateway answered as a message item and function_call items) unless both carry the gateway's ids
    and those name different calls; so an answer sent back maps to exactly the chat message ``Gateway.answer``
    gave."""
    out: list[dict] = []
    # the call index in the id of the item the last message came from (None: no id of the gateway's)
    last_from: int | None = None
    for i, raw in enumerate(items):
        item = _at(f"input[{i}]", raw, Item)
        kind = item.type or ("message" if item.role is not None else None)
        found = _ITEM_ID.match(item.id or "")
        origin = int(found.group(1)) if found else None
        if kind == "message":
            if item.role not in ROLES:
                raise _bad(f"input[{i}].role", f"expected one of {', '.join(ROLES)}, got {json.dumps(item.role)[:60]}")
            out.append({"role": ROLES[item.role], "content": _text(item.content, f"input[{i}].content")})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if getattr(item, name) is None:
                    raise _bad(f"input[{i}].{name}", "expected a string (a function_call item has it)", "missing")
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            prev = out[-1] if out else None
            joins = prev is not None and prev["role"] == "assistant"
            if joins and origin is not None and last_from is not None and origin != last_from:
                joins = False
            if joins:
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.call_id is None:
                raise _bad(f"input[{i}].call_id", "expected a string (a function_call_output item has it)", "missing")
            if item.output is None:
                raise _bad(f"input[{i}].output", "expected a string or text parts", "missing")
            out.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"input[{i}].output")}
            )
        else:
            raise _bad(
                f"input[{i}].type",
                f"expected message, function_call or function_call_output, got {json.dumps(kind)[:60]}",
                "unsupported_value",
            )
        last_from = origin
    return out


def chat_tools(tools: list[Tool] | None) -> list[dict] | None:
    """Function tools as chat tools; any other tool type (hosted tools: web_search, file_search, ...) refused."""
    out = []
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise _bad(
                f"tools[{i}].type",
                f"only function tools are served (the agent runs its tools), got {json.dumps(tool.type)[:60]}",
                "unsupported_value",
            )
        if not tool.name:
            raise _bad(f"tools[{i}].name", "expected the function's name", "missing")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.parameters if tool.parameters is not None else {"type": "object"}
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out or None


def refuse_unservable(req: Responses, body: dict) -> None:
    """A 400 naming each field that would change the answer and that the policy cannot honour."""
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False, 0, [], {}):
            raise _bad(name, f"not supported: {why}", "unsupported_value")
    if req.truncation not in (None, "disabled"):
        raise _bad("truncation", f"only 'disabled' (the prompt is never cut), got {json.dumps(req.truncation)}")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise _bad("reasoning", "reasoning settings cannot be honoured (the policy samples as it was trained)")
    if req.include:
        raise _bad("include", f"nothing extra can be included, got {json.dumps(req.include)[:80]}", "unsupported_value")
    if req.text is not None:
        fmt = req.text.format
        if fmt is not None and fmt.get("type") != "text":
            raise _bad(
                "text.format",
                f"only {{'type': 'text'}} (no JSON mode or schema-constrained decoding), got {json.dumps(fmt)[:80]}",
                "unsupported_value",
            )
        if req.text.verbosity is not None:
            raise _bad("text.verbosity", "verbosity cannot be honoured", "unsupported_value")


@dataclass
class Prepared:
    episode_id: str
    index: int
    model: str
    stream: bool
    # what the response echoes of its request
    echo: dict
    # a forced tool call's opening, which the streamed text starts with (Gateway.tool_choice)
    prefill: str = ""
    # the episode's events as the request read them (Gateway.follow reads on from them)
    seen: list | None = None


class ResponsesApi:
    def __init__(self, gw: Gateway):
        self.gw = gw

    # --- the request
    def prepare(self, episode_id: str, body: Any, headers=None) -> Prepared:
        req = schema.parse(body, Responses)
        refuse_unservable(req, body)
        tools = chat_tools(req.tools)
        choice = req.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            # Responses' {"type": "function", "name"} is chat's {"type": "function", "function": {"name"}}
            choice = {"type": "function", "function": {"name": choice.get("name")}}
            if choice["function"]["name"] not in [t["function"]["name"] for t in tools or []]:
                raise _bad(
                    "tool_choice.name",
                    f"{json.dumps(choice['function']['name'])[:60]} is not one of the request's function tools",
                )
        choice = self.gw.tool_choice(choice, tools)
        sampling = self.gw.sampling(
            model=req.model,
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=("max_output_tokens", req.max_output_tokens),
            stop=("stop", []),
        )
        given = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else messages_of(req.input)
        if req.previous_response_id is not None:
            messages = self._continued(episode_id, req.previous_response_id, req.instructions) + given
        else:
            messages = (
                [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
            ) + given
        if not messages:
            raise _bad("input", "expected at least one input item")
        if req.parallel_tool_calls is False and tools and choice != "none":
            # one tool call at most: the call ends at the first call's closing tag, kept in the answer's parse
            sampling = {**sampling, "stop_kept": [toolparse.CLOSE]}
        made = self.gw.chat_calls(episode_id, messages, tools, sampling, Ask.of(headers), 1, choice)
        [index] = made.calls
        echo = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "store": req.store is not False,
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [schema.raw(t) for t in req.tools or []],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "user": req.user,
        }
        return Prepared(
            episode_id,
            index,
            req.model or self.gw.model_names[0],
            bool(req.stream),
            echo,
            self.gw.prefill(choice),
            made.seen,
        )

    def _continued(self, episode_id: str, previous: str, instructions: str | None) -> list[dict]:
        """The conversation up to and including the answer of the response ``previous`` names, from the log.
        ``instructions`` stand in for its leading system message (OpenAI does not carry them over): equal, the
        new call extends that one exactly."""
        found = _ID.match(previous)
        ep = self.gw._episode(episode_id)
        index = int(found.group(1)) if found else -1
        if not found or found.group(2) != response_tag(self.gw.keys.run, episode_id, index) or index not in ep.calls:
            raise _bad(
                "previous_response_id",
                f"{previous[:80]!r} is no response of episode {episode_id!r} (ids name a call of the episode)",
                "previous_response_not_found",
            )
        call = ep.calls[index]
        if not call.done:
            call = self.gw.wait_done(episode_id, index)
        try:
            logged = json.loads(call.messages)["messages"]
        except (ValueError, KeyError, TypeError):
            raise _bad(
                "previous_response_id", f"call {index} of episode {episode_id!r} was no chat call", "invalid_value"
            ) from None
        answer, _, _ = self.gw.answer(call)
        history = [*logged, answer]
        if instructions is not None:
            lead = {"role": "system", "content": instructions}
            if history[0].get("role") == "system":
                history[0] = lead if history[0].get("content") != instructions else history[0]
            else:
                history.insert(0, lead)
        return history

    # --- the answer
    def _stem(self, prep: Prepared) -> str:
        return f"{prep.index}_{response_tag(self.gw.keys.run, prep.episode_id, prep.index)}"

    def _response(self, prep: Prepared, status: str, output: list[dict], call: Call | None) -> dict:
        out = {
            "id": f"resp_{self._stem(prep)}",
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": prep.model,
            "output": output,
            "reasoning": None,
            "usage": None,
            **prep.echo,
            "streamrl": {"episode": prep.episode_id, "call": prep.index},
        }
        if call is not None:
            prompt, completion = len(call.prompt_ids), len(call.tokens)
            # the prefix an extending call reused from its parent: never rendered again
            cached = prompt - len(call.new_ids) if call.extends >= 0 else 0
            out["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
        return out

    def _answer(self, prep: Prepared, call: Call) -> tuple[dict, str]:
        message, reason, problems = self.gw.answer(call)
        if problems:
            self.gw.log.warning(
                "tool call not parsed; answered as text", episode=prep.episode_id, call=call.index, problems=problems
            )
        return message, "incomplete" if reason == "length" else "completed"

    def _message_item(self, prep: Prepared, text: str, done: bool = True) -> dict:
        """The answer's message item; not ``done``: as it is first announced in a stream (no content yet)."""
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
        status = "completed" if done else "in_progress"
        return {
            "id": f"msg_{self._stem(prep)}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _call_items(self, prep: Prepared, message: dict) -> list[dict]:
        return [
            {
                "id": f"fc_{self._stem(prep)}_{k}",
                "type": "function_call",
                "status": "completed",
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
            }
            for k, c in enumerate(message.get("tool_calls") or [])
        ]

    def whole(self, prep: Prepared) -> dict:
        call = self.gw.wait_done(prep.episode_id, prep.index, prep.seen)
        message, status = self._answer(prep, call)
        calls = self._call_items(prep, message)
        output = [self._message_item(prep, message["content"] or "")] if message["content"] or not calls else []
        return self._response(prep, status, output + calls, call)

    def events(self, prep: Prepared) -> Iterator[str]:
        """Real streaming: text deltas as the tokens land in the episode stream (across aborts and resumes), then
        the tool calls, then the whole response."""
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        msg_id = f"msg_{self._stem(prep)}"
        where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
        opened, sent, output = False, "", []

        def open_message() -> Iterator[str]:
            yield event("response.output_item.added", output_index=0, item=self._message_item(prep, "", done=False))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part)

        try:
            yield event("response.created", response=self._response(prep, "in_progress", [], None))
            yield event("response.in_progress", response=self._response(prep, "in_progress", [], None))
            for kind, value in self.gw.follow(prep.episode_id, prep.index, 24 * 3600.0, prep.seen):
                if kind == "stopping":
                    # the process is stopping: the stream ends unfinished (the client sees a broken stream)
                    return
                if kind == "wait":
                    # keeps proxies and clients from timing out during a sync
                    yield ": still generating\n\n"
                elif kind == "tokens":
                    text = prep.prefill + self.gw.tok.decode(value, skip_special_tokens=True)
                    upto = toolparse.safe_prefix_len(text)
                    if upto > len(sent):
                        if not opened:
                            yield from open_message()
                            opened = True
                        yield event("response.output_text.delta", **where, delta=text[len(sent) : upto], logprobs=[])
                        sent = text[:upto]
                elif kind == "done":
                    call = value
                    message, status = self._answer(prep, call)
                    content = message["content"] or ""
                    calls = self._call_items(prep, message)
                    if content and not opened:
                        yield from open_message()
                        opened = True
                    if opened:
                        # the answer's text is the authority (a tool call's text is stripped); deltas add up to it
                        # but for whitespace cut before a tool call
                        if content.startswith(sent) and len(content) > len(sent):
                            yield event("response.output_text.delta", **where, delta=content[len(sent) :], logprobs=[])
                        yield event("response.output_text.done", **where, text=content, logprobs=[])
                        item = self._message_item(prep, content)
                        yield event("response.content_part.done", **where, part=item["content"][0])
                        yield event("response.output_item.done", output_index=0, item=item)
                        output.append(item)
                    for item in calls:
                        at = len(output)
                        yield event("response.output_item.added", output_index=at, item={**item, "arguments": ""})
                        ids = {"item_id": item["id"], "output_index": at}
                        yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
                        yield event(
                            "response.function_call_arguments.done",
                            **ids,
                            name=item["name"],
                            arguments=item["arguments"],
                        )
                        yield event("response.output_item.done", output_index=at, item=item)
                        output.append(item)
                    if not output:
                        item = self._message_item(prep, "")
                        yield from open_message()
                        yield event("response.output_text.done", **where, text="", logprobs=[])
                        yield event("response.content_part.done", **where, part=item["content"][0])
                        yield event("response.output_item.done", output_index=0, item=item)
                        output.append(item)
                    final = "response.completed" if status == "completed" else "response.incomplete"
                    yield event(final, response=self._response(prep, status, output, call))
                    return
        except GatewayError as exc:
            yield event("error", code=exc.code, message=exc.message, param=exc.param)


def route(gw: Gateway) -> Route:
    """The route that serves ``POST /ep/<episode>/v1/responses``."""
    api = ResponsesApi(gw)

    async def responses(request: Request):
        episode_id = request.path_params["episode_id"]
        body = await read_body(request)
        prep = await threads.run(api.prepare, episode_id, body, request.headers)
        if prep.stream:
            return StreamingResponse(
                api.events(prep), media_type="text/event-stream", headers={"cache-control": "no-cache"}
            )
        # rendered in the pool thread too, off the event loop
        return await threads.run(lambda: JSONResponse(api.whole(prep)))

    return Route("/ep/{episode_id}/v1/responses", responses, methods=["POST"])
