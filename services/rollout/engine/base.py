"""The engine contract every inference backend implements (torch built-in, vLLM).

The rollout worker drives an engine by polling: it adds requests, calls
``step()`` until nothing is left, and dispatches the returned chunks to its
episodes. An engine never knows about Redis, episodes or tools.

Resumability rests on two promises:
- ``abort`` returns every token generated for a request that ``step`` has not
  yet returned, so the caller can record them before they are lost;
- sampling is a pure function of (seed, position in the response): a request
  restarted from prompt + the first k response tokens, with the same seed and
  ``start_index=k``, draws the same random numbers as the uninterrupted run did
  from position k on. Same weights + same seed => same tokens, aborted or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.protocol.episode.routes import RouteShape


@dataclass(slots=True)
class SamplingParams:
    # 0 means greedy
    temperature: float = 1.0
    # nucleus mass kept, (0, 1]
    top_p: float = 1.0
    # 0 means no top-k cut
    top_k: int = 0
    # response budget of the whole episode turn
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    # stop strings, matched on the decoded text by the caller (``stops.first_stop``; the calls server), not by
    # the engines, which stop on token ids only: "stop" ones are cut from the answer, "stop_kept" ones stay
    stop: tuple[str, ...] = ()
    stop_kept: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "seed": self.seed,
        }
        # absent when unused: the logged sampling of a call without stop strings is as it always was
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_kept:
            out["stop_kept"] = list(self.stop_kept)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(
            temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)),
            top_k=int(d.get("top_k", 0)),
            max_tokens=int(d.get("max_tokens", 64)),
            stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())),
            seed=int(d.get("seed", 0)),
            stop=tuple(str(x) for x in d.get("stop", ())),
            stop_kept=tuple(str(x) for x in d.get("stop_kept", ())),
        )


@dataclass(slots=True)
class Chunk:
    """New tokens of one request since the last chunk for it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    # log-prob of each sampled token under the sampling distribution
    logprobs: list[float] = field(default_factory=list)
    # policy version of the weights that produced these tokens
    version: int = 0
    # None while running; "stop", "length" or "abort" when done
    finish_reason: str | None = None
    # a mixture-of-experts policy with routing_replay on: each token's experts per MoE layer, [n, layers, top_k]
    # uint8/uint16 sorted within a layer (shared/protocol/episode/routes.py); None when the engine records none
    routes: Any = None


class EngineError(Exception):
    """A request the engine cannot serve (prompt too long, bad parameters)."""


def check_request(
    request_id: str, token_ids: list[int], params: SamplingParams, max_new_tokens: int, max_model_len: int, known: bool
) -> None:
    """What every engine refuses in ``add_request``, with the same message (``known``: the id is in the engine)."""
    if known:
        raise EngineError(f"request {request_id!r} is already in the engine")
    if not token_ids:
        raise EngineError(f"request {request_id!r}: empty prompt")
    if len(token_ids) + 1 > max_model_len:
        raise EngineError(
            f"request {request_id!r}: prompt of {len(token_ids)} tokens leaves no room to generate "
            f"within max_model_len={max_model_len}"
        )
    if max_new_tokens < 1:
        raise EngineError(f"request {request_id!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
        raise EngineError(
            f"request {request_id!r}: bad sampling params temperature={params.temperature} "
            f"top_p={params.top_p} top_k={params.top_k}"
        )


class Engine(Protocol):
    # policy version of the loaded weights
    version: int
    # prompt + response tokens one request may hold
    max_model_len: int
    # the routes its chunks carry (a mixture-of-experts model, routing_replay on); None: it records none
    route_shape: RouteShape | None

    def add_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, max_new_tokens: int, start_index: int = 0
    ) -> None:
        """Queue a generation continuing ``token_ids`` (prompt + response so far).

        ``max_new_tokens`` is the remaining budget; ``start_index`` is how many
        response tokens ``token_ids`` already holds (the sampling position).
        Raises EngineError when the request cannot fit ``max_model_len``.
        """

    def step(self) -> list[Chunk]:
        """Run one scheduling step (prefill of new requests and/or one decode step
        for the running batch); return the new tokens per request. Finished
        requests appear once with ``finish_reason`` set and then leave."""

    def abort(self, request_id: str) -> Chunk | None:
        """Stop one request; return its not-yet-returned tokens with finish_reason="abort"."""

    def abort_all(self) -> list[Chunk]:
        """Stop every request (waiting or running)."""

    def has_unfinished(self) -> bool: ...

    def load_weights(self, path: str, version: int) -> None:
        """Replace the weights with a safetensors file/folder; tag them ``version``.
        Only allowed when no request is running."""
