"""The built-in engine: a Hugging Face causal LM driven with continuous batching."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from services.rollout.engine.base import Chunk, EngineError, SamplingParams, check_request
from services.rollout.engine.model_runner import ModelRunner
from services.rollout.engine.sampler import sample
from services.rollout.engine.scheduler import Scheduler
from services.rollout.engine.sequence import Sequence


class TorchEngine:
    def __init__(
        self,
        model_dir: str,
        device: str = "cpu",
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        routing_replay: bool = False,
    ):
        if max_batch_size < 1:
            raise EngineError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.runner = ModelRunner(model_dir, device, routing_replay=routing_replay)
        self.route_shape = self.runner.route_shape
        self.max_model_len = max_model_len or self.runner.max_position_embeddings
        if not self.max_model_len:
            raise EngineError(f"model at {model_dir!r} has no max_position_embeddings: pass max_model_len")
        self.scheduler = Scheduler(max_batch_size, self.max_model_len)
        self.version = 0

    def add_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, max_new_tokens: int, start_index: int = 0
    ) -> None:
        check_request(request_id, token_ids, params, max_new_tokens, self.max_model_len, request_id in self.scheduler)
        self.scheduler.add(Sequence(request_id, list(token_ids), params, max_new_tokens, start_index))

    def step(self) -> list[Chunk]:
        running = self.scheduler.running
        decoding = [running[rid] for rid in self.runner.rows]
        if decoding:
            self._sample(decoding, self.runner.decode([s.last_token for s in decoding]))
        admitted = self.scheduler.admit()
        if admitted:
            self._sample(admitted, self.runner.prefill([(s.request_id, s.token_ids) for s in admitted]))
        chunks = [self._chunk(s) for s in decoding + admitted]
        finished = [c.request_id for c in chunks if c.finish_reason]
        for rid in finished:
            self.scheduler.remove(rid)
        self.runner.remove(finished)
        return chunks

    def abort(self, request_id: str) -> Chunk | None:
        seq = self.scheduler.remove(request_id)
        if seq is None:
            return None
        self.runner.remove([request_id])
        return self._chunk(seq)

    def abort_all(self) -> list[Chunk]:
        seqs = [*self.scheduler.running.values(), *self.scheduler.waiting]
        return [chunk for s in seqs if (chunk := self.abort(s.request_id))]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def load_weights(self, path: str, version: int) -> None:
        if self.has_unfinished():
            raise EngineError("load_weights while requests are in flight: abort or finish them first")
        self.runner.load_state_dict(_read_safetensors(Path(path)))
        self.version = version

    def _sample(self, seqs: list[Sequence], logits) -> None:
        tokens, logprobs = sample(logits, [s.params for s in seqs], [s.position for s in seqs])
        # the experts each row's last position went through: the route of the token sampled from its logits
        routes = self.runner.last_routes(len(seqs))
        for i, (seq, token, logprob) in enumerate(zip(seqs, tokens, logprobs)):
            seq.append(token, logprob, None if routes is None else routes[i])
            self.scheduler.check_finished(seq)

    def _chunk(self, seq: Sequence) -> Chunk:
        tokens, logprobs, routes = seq.take_new()
        stacked = np.stack(routes) if routes else None
        return Chunk(seq.request_id, tokens, logprobs, self.version, seq.finish_reason, stacked)


def _read_safetensors(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise EngineError(f"no safetensors weights at {str(path)!r}")
    tensors = {}
    try:
        for f in files:
            tensors.update(load_file(str(f)))
    except (SafetensorError, OSError) as exc:
        raise EngineError(f"cannot read weights {str(path)!r}: {exc}") from exc
    return tensors
