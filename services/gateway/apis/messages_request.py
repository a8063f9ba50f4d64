"""An Anthropic Messages request, read and rendered as the chat call it asks for.

Parsed strictly with ``schema.parse`` (each problem a 400 naming the field, ``messages[1].content[0].type``), then
translated: ``system`` becomes a first system message; a user turn's text blocks a user message and each
``tool_result`` a ``tool`` message (``tool_call_id`` = ``tool_use_id``); an assistant turn's text and ``tool_use``
blocks one assistant message with ``tool_calls`` (``input`` as JSON arguments); ``tools`` chat function tools. An
assistant turn the gateway answered maps back to exactly the chat message ``Gateway.answer`` made for it (same
text, same tool names and arguments), so ``chat.find_parent`` finds the call it extends: exact ids across turns.
What the policy cannot do (images, documents, thinking, server tools, forced tool use, a prefilled answer) is
refused, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from services.gateway import schema
from services.gateway.errors import GatewayError


class _Block(BaseModel):
    # blocks carry hints (cache_control, citations) the gateway has no use for: let through, as chat's extras
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Text(_Block):
    type: str
    text: str


class ToolUse(_Block):
    type: str
    id: str
    name: str
    # as the gateway answered it: a JSON object (any JSON value is taken back as sent)
    input: Any


class ToolResult(_Block):
    type: str
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class Tool(_Block):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None


class ToolChoice(_Block):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Message(_Block):
    role: str
    content: str | list[dict[str, Any]]


class Request(BaseModel):
    # every field of the request is read, accepted as a no-op by design, or refused: an unknown one is a 400
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str
    messages: list[Message]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    # accepted and ignored: a user id for abuse tracking, a capacity tier, a prompt-caching hint; none changes the
    # answer
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    # read only to refuse it
    thinking: Any = None


# custom tools (the only kind a policy can call: server tools run on Anthropic's side)
CUSTOM_TOOL_TYPES = (None, "custom")
# blocks a policy that reads text cannot take
UNSUPPORTED = {
    "image": "images",
    "document": "documents",
    "search_result": "search results",
    "thinking": "thinking blocks",
    "redacted_thinking": "thinking blocks",
    "server_tool_use": "server tools",
    "web_search_tool_result": "server tools",
    "container_upload": "container uploads",
}


@dataclass
class Chat:
    """The chat call a Messages request asks for."""

    messages: list[dict]
    tools: list[dict] | None
    stream: bool
    model: str
    max_tokens: int
    temperature: float | None
    top_p: float | None
    stops: list[str]
    # chat's tool_choice ("none", "required", a named function; None: auto) and whether one tool call at most
    tool_choice: Any = None
    one_tool_call: bool = False


def _bad(param: str, message: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, f"{param}: {message}", param, code)


def _at(prefix: str, value: Any, kind: type[BaseModel]):
    """``value`` parsed as ``kind`` (schema.parse), a problem named from ``prefix`` (``messages[1].content[0]``)."""
    try:
        return schema.parse(value, kind)
    except GatewayError as exc:
        inner = exc.param if exc.param and exc.param != "body" else ""
        where = f"{prefix}.{inner}" if inner and not inner.startswith("[") else f"{prefix}{inner}"
        message = exc.message.removeprefix(f"{exc.param}: ") if exc.param else "expected a JSON object"
        raise GatewayError(400, f"{where}: {message}", where, exc.code) from None


def _block_type(where: str, block: dict, allowed: tuple[str, ...]) -> str:
    kind = block.get("type")
    if isinstance(kind, str) and kind in allowed:
        return kind
    if isinstance(kind, str) and kind in UNSUPPORTED:
        raise _bad(f"{where}.type", f"{UNSUPPORTED[kind]} are not supported (the policy reads text only), got {kind!r}")
    raise _bad(f"{where}.type", f"expected one of {', '.join(allowed)}, got {json.dumps(kind)[:40]}")


def _texts(where: str, content: str | list[dict] | None) -> str:
    """A string, or text blocks joined: system prompts, tool results."""
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for k, block in enumerate(content):
        _block_type(f"{where}[{k}]", block, ("text",))
        out.append(_at(f"{where}[{k}]", block, Text).text)
    return "".join(out)


def _user(i: int, content: list[dict]) -> list[dict]:
    """A user turn's blocks in order: runs of text as user messages, each tool result as a tool message."""
    out, parts = [], []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = _block_type(where, block, ("text", "tool_result"))
        if kind == "text":
            parts.append({"type": "text", "text": _at(where, block, Text).text})
            continue
        if parts:
            out.append({"role": "user", "content": parts})
            parts = []
        result = _at(where, block, ToolResult)
        text = _texts(f"{where}.content", result.content)
        # the chat template has no error flag: the model reads it in the result
        out.append(
            {
                "role": "tool",
                "tool_call_id": result.tool_use_id,
                "content": f"Error: {text}" if result.is_error else text,
            }
        )
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant(i: int, content: list[dict]) -> dict:
    """An assistant turn as one chat message. With tool calls its text is stripped, as the gateway's own answer's
    is (a streamed answer may have sent the whitespace around a tool call): the turn it answered maps back."""
    text, calls = [], []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if _block_type(where, block, ("text", "tool_use")) == "text":
            text.append(_at(where, block, Text).text)
            continue
        use = _at(where, block, ToolUse)
        calls.append(
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
        )
    joined = "".join(text)
    if not calls:
        return {"role": "assistant", "content": joined}
    return {"role": "assistant", "content": joined.strip(), "tool_calls": calls}


def _tools(tools: list[dict]) -> list[dict]:
    out = []
    for i, raw in enumerate(tools):
        if raw.get("type") not in CUSTOM_TOOL_TYPES:
            raise _bad(
                f"tools[{i}].type",
                f"only custom tools (no type, or 'custom') can be called by the policy; server tools run on "
                f"Anthropic's side, got {json.dumps(raw.get('type'))[:60]}",
                "unsupported_value",
            )
        tool = _at(f"tools[{i}]", raw, Tool)
        function: dict = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict | None) -> tuple[Any, bool]:
    """Anthropic's ``tool_choice`` as chat's (``auto``: None, ``any``: "required", ``tool``: a named function,
    ``none``) and whether ``disable_parallel_tool_use`` asks for one tool call at most; the gateway honours chat's
    (``Gateway.tool_choice``: a forced call is prefilled, none answers text only)."""
    if choice is None:
        return None, False
    parsed = _at("tool_choice", choice, ToolChoice)
    one = bool(parsed.disable_parallel_tool_use)
    if parsed.type == "auto":
        return None, one
    if parsed.type == "none":
        return "none", one
    if parsed.type == "any":
        return "required", one
    if parsed.type == "tool":
        if not isinstance(parsed.name, str):
            raise _bad("tool_choice.name", "expected the name of one of the request's tools")
        return {"type": "function", "function": {"name": parsed.name}}, one
    raise _bad("tool_choice.type", f"expected 'auto', 'any', 'tool' or 'none', got {json.dumps(parsed.type)[:40]}")


def read(body: Any, top_k: int) -> Chat:
    """The chat call a Messages body asks for, or GatewayError 400 naming the field (``top_k``: the server's)."""
    req = schema.parse(body, Request)
    if req.thinking is not None:
        raise _bad("thinking", "extended thinking is not supported (the policy samples its answer directly)")
    if req.temperature is not None and not 0 <= req.temperature <= 1:
        raise _bad("temperature", f"expected >= 0 and <= 1, got {req.temperature}")
    if req.top_k is not None and req.top_k != top_k:
        raise _bad(
            "top_k",
            f"the policy samples with the server's top_k ({top_k}; 0: off): expected {top_k} or null, got {req.top_k}",
        )
    if not req.messages:
        raise _bad("messages", "expected a non-empty array of messages")
    messages = []
    if req.system is not None:
        system = _texts("system", req.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise _bad(f"messages[{i}].role", f"expected 'user' or 'assistant', got {json.dumps(m.role)[:40]}")
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages += _user(i, m.content)
        else:
            messages.append(_assistant(i, m.content))
    last = len(req.messages) - 1
    if req.messages[last].role != "user":
        raise _bad(
            f"messages[{last}].role",
            "the last message must be the user's: a prefilled assistant turn cannot be continued (each call "
            "answers in a new assistant turn)",
        )
    tools = _tools(req.tools) if req.tools else None
    choice, one = _tool_choice(req.tool_choice)
    return Chat(
        messages,
        tools,
        bool(req.stream),
        req.model,
        req.max_tokens,
        req.temperature,
        req.top_p,
        list(req.stop_sequences or []),
        choice,
        one,
    )
