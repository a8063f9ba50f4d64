"""Per-request state of the torch engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from services.rollout.engine.base import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class Sequence:
    request_id: str
    # prompt + response so far, grows as tokens are sampled
    token_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    # response tokens already in the prompt when the request arrived
    start_index: int = 0
    prompt_len: int = field(init=False)
    logprobs: list[float] = field(default_factory=list)
    # a mixture-of-experts model recording routes: each generated token's [layers, top_k] experts
    routes: list = field(default_factory=list)
    # generated tokens already handed out in a chunk
    num_returned: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.prompt_len = len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def position(self) -> int:
        """Index in the response of the next token to sample: what seeds its randomness."""
        return self.start_index + self.num_generated

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def append(self, token: int, logprob: float, route=None) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if route is not None:
            self.routes.append(route)

    def take_new(self) -> tuple[list[int], list[float], list]:
        """Generated tokens (with log-probs, and routes when recorded) not yet returned; marks them returned."""
        start = self.prompt_len + self.num_returned
        tokens, logprobs = self.token_ids[start:], self.logprobs[self.num_returned :]
        routes = self.routes[self.num_returned :]
        self.num_returned = self.num_generated
        return tokens, logprobs, routes
