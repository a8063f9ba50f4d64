"""What the gateway accepts as a request body before it looks at its fields: at most ``MAX_BODY`` bytes, JSON
nested at most ``MAX_DEPTH`` deep, no NaN or Infinity literals (plain JSON has none; Python's parser would take
them). Each refusal is a 4xx ``GatewayError`` naming what was wrong."""

from __future__ import annotations

import json

from services.gateway.errors import GatewayError

# bytes of one request body (413 beyond)
MAX_BODY = 8 << 20
# nesting of arrays and objects (a chat request needs about 6)
MAX_DEPTH = 64


def _constant(name: str):
    raise GatewayError(400, f"request body: {name} is not a JSON number (finite numbers only)", None, "invalid_json")


def depth(value) -> int:
    """How deeply ``value`` nests lists and dicts (iterative: no recursion limit to hit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                return level
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_body(raw: bytes):
    """The JSON of a request body, or a 400 naming what is wrong with it."""
    try:
        body = json.loads(raw or b"null", parse_constant=_constant)
    except RecursionError:
        raise GatewayError(400, f"request body: JSON nested deeper than {MAX_DEPTH}", None, "invalid_json") from None
    except ValueError as exc:
        raise GatewayError(400, f"request body: malformed JSON ({exc})", None, "invalid_json") from None
    if depth(body) > MAX_DEPTH:
        raise GatewayError(400, f"request body: JSON nested deeper than {MAX_DEPTH}", None, "invalid_json")
    return body


async def read_body(request) -> object:
    """A request's JSON body (a Starlette request), read as it arrives: 413 past ``MAX_BODY`` bytes (a body without
    a Content-Length is counted as it comes), 400 for what ``parse_body`` refuses."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise GatewayError(413, f"request body: more than {MAX_BODY} bytes", None, "body_too_large")
    return parse_body(bytes(raw))
