"""The agent loop, as pure per-episode transitions: what an episode does after each generated chunk, before
each generation turn and after a tool result. The rollout worker (tools as rq jobs, events to the stream) and
``replay --continue`` (tools in-process, nothing written) both drive an episode with it.

    next_turn(ep)            -> Finish | None (generate)
    after_chunk(ep, reason)  -> ToolCall | Finish | None (keep generating)
    add_result(ep, ok, out)  -> token ids appended to the response (masked: not trained on)

``ep`` is a ``LiveEpisode`` (``services.rollout.episodes.live``); the transitions update its counters in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from services.rollout.episodes.live import LiveEpisode
from services.rollout.jobs import tools as tools_mod


@dataclass(frozen=True)
class ToolCall:
    call_id: str
    # "?" for a malformed call
    name: str
    args: str
    # malformed or unknown tool: answered with this error at once, nothing runs
    error: str | None = None


@dataclass(frozen=True)
class Finish:
    # 'stop', 'length', 'context', 'tool_limit' (the ``finished`` event's reason)
    reason: str


@dataclass(frozen=True)
class Malformed:
    message: str


class Agent:
    def __init__(self, tokenizer, tool_names: Iterable[str], max_tool_calls: int, max_model_len: int):
        self.tok, self.tool_names = tokenizer, frozenset(tool_names)
        self.max_tool_calls, self.max_model_len = max_tool_calls, max_model_len

    def next_turn(self, ep: LiveEpisode) -> Finish | None:
        """Before a generation request: the episode's end, or None to generate."""
        if len(ep.tokens) > ep.turn_start and ep.tokens[-1] in ep.params.stop_token_ids:
            # the stream already ends the episode (a crash before its 'finished')
            return Finish("stop")
        if ep.remaining <= 0:
            return Finish("length")
        if len(ep.context_ids) >= self.max_model_len:
            return Finish("context")
        return None

    def after_chunk(self, ep: LiveEpisode, finish_reason: str | None) -> ToolCall | Finish | None:
        """After a chunk's tokens are in ``ep.tokens``. A ToolCall while the engine still runs the request:
        the caller aborts the request (and records what it returns) before answering the call."""
        if finish_reason == "abort":
            return None
        detected = self.detect_call(ep) if self.tool_names else None
        if detected is not None:
            return self.call(ep, detected)
        if finish_reason is None:
            return None
        return Finish("context" if finish_reason == "length" and ep.remaining > 0 else finish_reason)

    def detect_call(self, ep: LiveEpisode) -> tuple[str, str] | Malformed | None:
        tail = self.tok.decode(ep.tokens[max(ep.turn_start, len(ep.tokens) - 16) :])
        if tools_mod.CALL_CLOSE not in tail:
            return None
        try:
            return tools_mod.parse_call(self.tok.decode(ep.tokens[ep.turn_start :])) or Malformed(
                "malformed tool call: '</call>' without '<call>'"
            )
        except tools_mod.ToolError as exc:
            return Malformed(str(exc))

    def call(self, ep: LiveEpisode, detected: tuple[str, str] | Malformed) -> ToolCall | Finish:
        if ep.num_tool_calls >= self.max_tool_calls:
            return Finish("tool_limit")
        ep.num_tool_calls += 1
        call_id = f"c{ep.num_tool_calls}"
        if isinstance(detected, Malformed):
            return ToolCall(call_id, "?", "", detected.message)
        return self.checked(ToolCall(call_id, *detected))

    def checked(self, call: ToolCall) -> ToolCall:
        """``call`` with an error when its tool is not configured (also for a call pending in a stream)."""
        if call.error is None and call.name not in self.tool_names:
            available = ", ".join(sorted(self.tool_names))
            return ToolCall(call.call_id, call.name, call.args, f"unknown tool {call.name!r}; available: {available}")
        return call

    def result_ids(self, ok: bool, output: str) -> list[int]:
        return self.tok.encode(
            tools_mod.format_result(ok, output[: tools_mod.MAX_OUTPUT_CHARS]), add_special_tokens=False
        )

    def add_result(self, ep: LiveEpisode, ids: list[int]) -> None:
        """A tool result's tokens join the response; the next generation turn starts after them."""
        ep.tokens += ids
        ep.turn_start = len(ep.tokens)

    @staticmethod
    def add_generated(ep: LiveEpisode, ids: list[int]) -> None:
        ep.tokens += ids
        ep.num_generated += len(ids)
