"""The shape of a request body, checked with pydantic before any field is used: each field the gateway reads
has its JSON type (strict: true is not a number, "1" is not an integer; numbers finite), every other field is
let through as OpenAI clients send many. ``parse`` is the one parse of a body: the first problem is a 400 naming
the field (``messages[0].tool_calls``), and what comes back is the typed request the handlers read; what pydantic
cannot say (ranges, meanings: a known model, stop strings) is checked after, in ``core.py``; the fields the gateway
refuses or takes as no-ops are listed in ``fields.py``."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from services.gateway.errors import GatewayError


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Function(_Open):
    name: str


# a tool, or a tool call: {"type": "function", "function": {"name": ...}}
class Named(_Open):
    function: Function


class Message(_Open):
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Named] | None = None


class _Common(_Open):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    stream: bool | None = None
    logprobs: bool | None = None
    stop: str | list[str] | None = None
    stream_options: dict[str, Any] | None = None
    # the call's sampling seed (default: one of the episode, the call and its request)
    seed: int | None = None
    # vLLM's: the prompt's and the completion's token ids in the answer
    return_token_ids: bool | None = None


class Chat(_Common):
    messages: list[Message]
    tools: list[Named] | None = None
    # none / auto / required / a named function (core.Gateway.tool_choice)
    tool_choice: str | dict[str, Any] | None = None
    # false: the call stops after its first complete tool call
    parallel_tool_calls: bool | None = None
    # text / json_object / json_schema: a hint in the prompt, not enforced (core.Gateway.format_hint)
    response_format: dict[str, Any] | None = None


class Completion(_Common):
    prompt: str | list[int]
    # the legacy API's: how many top log-probs (0: the sampled token's only)
    logprobs: bool | int | None = None


R = TypeVar("R", bound="_Common")


def raw(model: BaseModel) -> dict:
    """The part of the body a request came from: the fields it set (extras included), nothing added; declared
    fields come first, so where the order of keys matters (what a template renders) read the body itself."""
    return model.model_dump(exclude_unset=True)


_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def _param(loc: tuple) -> str:
    """pydantic's error location as the field's path (``messages[0].role``); a union's type tags left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part.lower().split("-")[0] in _TYPE_TAGS:
            break
        else:
            out += f".{part}" if out else part
    return out or "body"


def parse(body: Any, kind: type[R]) -> R:
    """``body`` as a ``kind`` request, or GatewayError 400 naming the first field whose type is wrong."""
    if not isinstance(body, dict):
        raise GatewayError(400, "request body: expected a JSON object", None, "invalid_type")
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = _param(err["loc"])
        got = json.dumps(err.get("input"), default=str)[:80] if err["type"] != "missing" else "nothing"
        raise GatewayError(
            400, f"{param}: {err['msg'][0].lower()}{err['msg'][1:]} (got {got})", param, "invalid_type"
        ) from None
