"""One episode as a rollout worker drives it: the in-memory mirror of its stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from services.rollout.engine import SamplingParams
from shared.protocol.episode.fold import Episode

# re-exported: the rule lives in shared (segments use it)
from shared.protocol.episode.sampling import episode_seed, stable_seed  # noqa: F401


class State(Enum):
    # a request is in the engine
    GENERATING = "generating"
    # waiting for a tool job
    TOOL = "tool"
    # generation over, waiting for the reward job
    SCORING = "scoring"
    # needs a generation request on resume
    PAUSED = "paused"
    # finished or failed, in the stream
    DONE = "done"


@dataclass
class LiveEpisode:
    episode_id: str
    group_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    task: dict
    # response so far, tool output included
    tokens: list[int] = field(default_factory=list)
    num_generated: int = 0
    # index in tokens where the current generation turn began
    turn_start: int = 0
    num_tool_calls: int = 0
    state: State = State.PAUSED
    # while SCORING: the reason its ``finished`` event will carry
    finish_reason: str | None = None

    @classmethod
    def from_fold(cls, ep: Episode, params: SamplingParams) -> "LiveEpisode":
        live = cls(
            ep.episode_id,
            ep.group_id,
            ep.index,
            ep.prompt_ids,
            params,
            ep.task,
            list(ep.tokens),
            ep.num_generated,
            num_tool_calls=len(ep.tool_calls),
        )
        # the current turn starts after the last tool result's tokens
        if ep.tool_results:
            live.turn_start = index_after_seq(ep, ep.tool_results[-1]["seq"])
        return live

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.tokens

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - self.num_generated


def index_after_seq(ep: Episode, seq: int) -> int:
    """Number of response tokens written by events up to and including ``seq``."""
    count = 0
    for ev in ep.events:
        if ev.seq > seq:
            break
        if ev.kind == "tokens" or ev.kind == "tool_result":
            count += len(ev.data["ids"])
    return count
