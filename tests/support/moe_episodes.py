"""Mixture-of-experts episodes for tests: routes drawn at random, routed tokens events, and a real torch-engine rollout
of a tiny MoE written to the episode log with its routes."""

from __future__ import annotations

import numpy as np

from services.rollout.engine import SamplingParams
from services.rollout.engine.torch_engine import TorchEngine
from shared.protocol.episode import routes
from shared.protocol.episode.events import Event
from shared.protocol.episode.log import EpisodeLog

SHAPE = routes.RouteShape(layers=3, top_k=2, experts=8)
PROMPT = [5, 6, 7, 8, 9, 10]


def random_routes(n: int, shape: routes.RouteShape = SHAPE, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    picks = np.stack([rng.choice(shape.experts, shape.top_k, replace=False) for _ in range(n * shape.layers)])
    return routes.canonical(picks.reshape(n, shape.layers, shape.top_k), shape)


def routed_tokens(seq: int, ids, r: np.ndarray, policy: int = 0, call_index: int | None = None) -> Event:
    data = {"ids": list(ids), "logprobs": [-0.5] * len(ids), "routes": r}
    if call_index is not None:
        data["call"] = call_index
    return Event("tokens", policy, "w", seq, data)


def rollout(model_dir: str, n: int = 4, max_tokens: int = 12, seed: int = 0) -> list[tuple[list, list, np.ndarray]]:
    engine = TorchEngine(model_dir, max_batch_size=n, routing_replay=True)
    for i in range(n):
        engine.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=max_tokens, seed=seed + i), max_tokens)
    out = {f"r{i}": ([], [], []) for i in range(n)}
    while engine.has_unfinished():
        for c in engine.step():
            out[c.request_id][0].extend(c.token_ids)
            out[c.request_id][1].extend(c.logprobs)
            out[c.request_id][2].extend(c.routes)
    return [(t, lp, np.stack(r)) for t, lp, r in out.values()]


def write_group(client, keys, group_id: str, results, version: int = 0, routes_of=lambda i, r: r) -> list[str]:
    """Episodes of one group from ``rollout``'s results in the log, and their samples entry; ``routes_of(i, routes)``
    may change episode i's routes (bad input)."""
    log = EpisodeLog(client, keys, "writer")
    eids = []
    for i, (toks, lps, held) in enumerate(results):
        eid = f"{group_id}-{i}"
        eids.append(eid)
        log.open(eid)
        started = {"episode_id": eid, "group_id": group_id, "index": i, "prompt_ids": PROMPT, "sampling": {}}
        log.append(eid, "started", {**started, "task": {}}, version)
        log.append_tokens(eid, toks, lps, version, routes_of(i, held))
        log.append(eid, "finished", {"reason": "stop", "reward": float(i % 2)}, version)
    log.flush_or_raise()
    client.xadd(keys.samples, {"group_id": group_id, "episodes": ",".join(eids), "worker": "w", "n": str(len(eids))})
    return eids


class Forward:
    """One model's plain forward (batch of one, no cache) recording its routers: a token's route is the choice at
    the position before it. ``weights``: a published version's safetensors file to load over ``model_dir``'s."""

    def __init__(self, model_dir: str, weights=None):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        from shared.runtime.moe.routers import Routers

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        if weights is not None:
            self.model.load_state_dict(load_file(str(weights)), strict=True)
        self.routers = Routers.of(self.model)
        self.routers.recording = True

    def routes(self, prompt: list[int], tokens: list[int]) -> np.ndarray:
        """The route of each of ``tokens`` after ``prompt``: [len(tokens), layers, top_k]."""
        import torch

        ids = prompt + tokens
        with torch.no_grad():
            self.model(input_ids=torch.tensor([ids]))
        every = torch.stack(self.routers.recorded, dim=1).numpy()
        return routes.canonical(every[len(prompt) - 1 : len(ids) - 1], self.routers.shape)
