"""A simulated slow engine for drills and benchmarks: any engine, plus a fixed sleep after each ``step`` (a
memory-bound GPU decode step costs about the same whatever the batch) and, optionally, after each weight load (a
large model's weights take seconds to load on a GPU; the tiny model's take milliseconds).

``make_engine`` applies it when the config key ``step_delay_ms`` or ``simulated_load_ms`` is set (fault drills
stretch episodes so that a kill lands mid-generation); production configs leave both at 0 and never see it.
"""

from __future__ import annotations

import time

from services.rollout.engine.base import Chunk, Engine, SamplingParams


class SlowEngine:
    def __init__(self, inner: Engine, step_delay_ms: float, load_delay_ms: float = 0.0):
        self.inner, self.delay_s, self.load_delay_s = inner, step_delay_ms / 1000, load_delay_ms / 1000

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def route_shape(self):
        return self.inner.route_shape

    def add_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, max_new_tokens: int, start_index: int = 0
    ) -> None:
        self.inner.add_request(request_id, token_ids, params, max_new_tokens, start_index=start_index)

    def step(self) -> list[Chunk]:
        chunks = self.inner.step()
        time.sleep(self.delay_s)
        return chunks

    def abort(self, request_id: str) -> Chunk | None:
        return self.inner.abort(request_id)

    def abort_all(self) -> list[Chunk]:
        return self.inner.abort_all()

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def load_weights(self, path: str, version: int) -> None:
        self.inner.load_weights(path, version)
        time.sleep(self.load_delay_s)
