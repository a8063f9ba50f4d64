"""Hermes-style tool calls in model output: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

transformers' ``parse_response`` needs a response template shipped in the
tokenizer's config, which the tiny models (and many checkpoints) lack; vLLM's
parsers pull in vLLM. This is the small, well-tested subset every ChatML model
with Hermes tool calling writes. A malformed block stays in the text (plain
content) and is reported, never raised; a block inside ``<think>`` is not a call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.S)


@dataclass
class Parsed:
    content: str
    # {"name": str, "arguments": str (JSON text)}
    calls: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def parse(text: str) -> Parsed:
    # same offsets, calls in <think> hidden
    visible = _THINK.sub(lambda m: " " * len(m.group(0)), text)
    calls, problems, kept, pos = [], [], [], 0
    for m in _BLOCK.finditer(visible):
        body = text[m.start(1) : m.end(1)].strip()
        try:
            obj = json.loads(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError("expected an object with a string 'name'")
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                # must be JSON text already
                json.loads(args)
                arguments = args
            else:
                arguments = json.dumps(args)
        except ValueError as exc:
            problems.append(f"malformed tool call {body[:80]!r}: {exc}")
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append({"name": obj["name"], "arguments": arguments})
    kept.append(text[pos:])
    content = "".join(kept) if calls else text
    return Parsed(content.strip() if calls else content, calls, problems)


def safe_prefix_len(text: str) -> int:
    """How much of a growing text may be streamed as content now: up to the first tool call opening, and short of
    a tail that could still become one."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
