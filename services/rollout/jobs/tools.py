"""Tools the model may call, and how a call is written.

Syntax (what the model generates, documented for prompt writers):

    <call>NAME: ARGS</call>

The worker stops generation right after ``</call>``, runs the tool as an rq
job, and appends ``<result>OUTPUT</result>`` to the context (masked from the
loss). A tool that raises, exceeds ``tool_timeout``, is unknown, or returns
something other than a short string gives an error result
``<result>error: ...</result>``; the episode goes on.

Which tools exist is the config key ``tools``: a comma-separated list of
built-in names (``calc``) or ``module:function`` specs; a spec's tool is
called by its function name. A tool is ``fn(args: str) -> str``.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from typing import Callable

from shared.runtime import specs

CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
CALL_RE = re.compile(r"<call>(.*?)</call>\s*$", re.S)
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_OUTPUT_CHARS = 256
# built-in name -> spec
BUILTIN = {"calc": "services.rollout.jobs.tools:calc"}


class ToolError(Exception):
    pass


def parse_call(text: str) -> tuple[str, str] | None:
    """The call at the end of ``text`` as (name, args); None when there is none.
    A malformed call raises ToolError."""
    m = CALL_RE.search(text)
    if not m:
        return None
    body = m.group(1)
    if ":" not in body:
        raise ToolError(f"malformed tool call {body!r}: expected 'NAME: ARGS'")
    name, args = (part.strip() for part in body.split(":", 1))
    if not NAME_RE.match(name):
        raise ToolError(f"malformed tool call: bad tool name {name!r}")
    return name, args


def format_result(ok: bool, output: str) -> str:
    return f"<result>{output if ok else 'error: ' + output}</result>"


@functools.lru_cache(maxsize=16)
def registry(config: str) -> dict[str, Callable]:
    """{tool name: function} of the config key ``tools`` (comma-separated built-in names or specs)."""
    out: dict[str, Callable] = {}
    for item in (t.strip() for t in config.split(",")):
        if not item:
            continue
        spec = BUILTIN.get(item, item)
        if ":" not in spec:
            raise ValueError(
                f"config key 'tools': {item!r}: not a built-in tool ({', '.join(BUILTIN)}) nor a 'module:function' spec"
            )
        name = spec.rsplit(":", 1)[1]
        if name in out:
            raise ValueError(f"config key 'tools': {config!r}: two tools named {name!r}")
        out[name] = specs.load(spec, "tools")
    return out


def run_tool(config: str, name: str, args: str) -> str:
    """The rq job: run one tool call of the configured registry ``config``. Raises on every kind of failure."""
    tools = registry(config)
    if name not in tools:
        raise ToolError(f"unknown tool {name!r}")
    output = tools[name](args)
    if not isinstance(output, str):
        raise ToolError(f"tool {name!r} returned {type(output).__name__}, expected str")
    if len(output) > MAX_OUTPUT_CHARS:
        raise ToolError(f"tool {name!r} returned {len(output)} chars, more than {MAX_OUTPUT_CHARS}")
    return output


# --- the built-in tools ---------------------------------------------------

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**12:
            raise ToolError("result too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ToolError(f"unsupported expression element {type(node).__name__}")


def calc(args: str) -> str:
    """Integer arithmetic: + - * // % and parentheses."""
    try:
        return str(_eval(ast.parse(args.replace("/", "//").replace("////", "//"), mode="eval")))
    except (SyntaxError, ZeroDivisionError) as exc:
        raise ToolError(f"cannot evaluate {args!r}: {exc.__class__.__name__}") from None
