"""The torch engine on mixture-of-experts models records each sampled token's route: the experts every MoE layer
chose at the position whose logits drew it. Checked against a plain forward of the whole sequence, and across an
abort and resume (the prefix's routes kept, the rest the same as an uninterrupted run's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.rollout.engine import SamplingParams
from services.rollout.engine.torch_engine import TorchEngine
from shared.runtime.moe.routers import Routers
from tests.support.arch_models import make_arch_model
from tests.support.moe_episodes import Forward

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [11, 12], "c": [20, 21, 22]}


@pytest.fixture(scope="module", params=["qwen3-moe", "mixtral", "olmoe"])
def moe_dir(request, tmp_path_factory):
    return make_arch_model(request.param, tmp_path_factory.mktemp(request.param))


def generate(engine: TorchEngine, prompts: dict, max_tokens: int = 10, abort_after: int | None = None) -> dict:
    """{request: (tokens, routes [n, L, k])}; ``abort_after``: abort every request after that many steps and
    resume it from prompt + tokens so far (the rollout worker's pause), then finish."""
    out = {rid: ([], []) for rid in prompts}

    def take(chunk):
        out[chunk.request_id][0].extend(chunk.token_ids)
        if chunk.routes is not None:
            out[chunk.request_id][1].extend(chunk.routes)

    for i, (rid, ids) in enumerate(prompts.items()):
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, seed=i), max_tokens)
    steps = 0
    while engine.has_unfinished():
        if abort_after is not None and steps == abort_after:
            for chunk in engine.abort_all():
                take(chunk)
            for i, (rid, ids) in enumerate(prompts.items()):
                done = out[rid][0]
                if len(done) < max_tokens:
                    params = SamplingParams(max_tokens=max_tokens, seed=i)
                    engine.add_request(rid, ids + done, params, max_tokens - len(done), start_index=len(done))
            abort_after = None
        for chunk in engine.step():
            take(chunk)
        steps += 1
    return {rid: (toks, np.stack(r)) for rid, (toks, r) in out.items()}


def test_each_tokens_route_is_what_a_forward_of_the_whole_sequence_routes(moe_dir):
    engine = TorchEngine(moe_dir, max_batch_size=4, routing_replay=True)
    shape = engine.route_shape
    forward = Forward(moe_dir)
    assert shape is not None and shape.top_k == 2 and shape.experts == 8
    for rid, (toks, routes) in generate(engine, PROMPTS).items():
        assert routes.shape == (len(toks), shape.layers, shape.top_k) and routes.dtype == np.uint8
        expected = forward.routes(PROMPTS[rid], toks)
        assert np.array_equal(routes, expected), rid


def test_an_abort_and_resume_keeps_the_prefix_routes_and_routes_the_rest_as_an_uninterrupted_run(moe_dir):
    engine = TorchEngine(moe_dir, max_batch_size=4, routing_replay=True)
    whole = generate(engine, PROMPTS)
    resumed = generate(engine, PROMPTS, abort_after=4)
    for rid in PROMPTS:
        assert resumed[rid][0] == whole[rid][0]
        assert np.array_equal(resumed[rid][1], whole[rid][1]), rid


def test_a_dense_model_or_replay_off_records_no_routes(tiny_model_dir, moe_dir):
    for engine in (TorchEngine(tiny_model_dir, routing_replay=True), TorchEngine(moe_dir, routing_replay=False)):
        assert engine.route_shape is None
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=3), 3)
        chunks = [c for _ in range(5) for c in engine.step()]
        assert chunks and all(c.routes is None for c in chunks)


class FooTopKRouter(torch.nn.Module):
    """A router of a family replay does not know (a sigmoid scorer, say)."""

    def __init__(self):
        super().__init__()
        self.top_k, self.num_experts = 2, 4

    def forward(self, x):
        return x, x, x


def test_a_router_replay_does_not_know_is_refused_in_one_line(tmp_path):
    model = torch.nn.Sequential(FooTopKRouter())
    with pytest.raises(ValueError) as err:
        Routers.of(model)
    assert "FooTopKRouter" in str(err.value) and "routing_replay = false" in str(err.value)
    assert len(str(err.value).splitlines()) == 1
