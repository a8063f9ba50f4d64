"""The engine contract as the rollout worker relies on it, run for every engine.

The vLLM adapter runs these same tests (its parameter is skipped when vllm is
not importable). Everything is real: Redis, the model, the worker loop.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from shared.config import Config
from shared.prompts import PromptGroup, enqueue
from tests.rollout_harness import acks, episodes, make_worker, samples, send, tick_until

ENGINES = ["torch", pytest.param("vllm", marks=pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm not installed (CI runs it in its own venv)"))]

GROUPS = [("ga", 3), ("gb", 2)]


@pytest.fixture(params=ENGINES)
def engine_kind(request):
    return request.param


def _cfg(keys, model_dir, engine_kind, **kw) -> Config:
    base = dict(run=keys.run, model_dir=model_dir, engine=engine_kind, max_tokens=40, tools="", temperature=1.0,
                flush_tokens=4, flush_ms=1000.0, heartbeat_ttl=2.0)
    return Config(**{**base, **kw})


def _enqueue(client, keys):
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 12+7=") for g, n in GROUPS])


def _run(client, keys, cfg, on_tick=None):
    _enqueue(client, keys)
    worker = make_worker(cfg, client)
    tick_until(worker, lambda: len(samples(client, keys)) == len(GROUPS), on_tick=on_tick and
               (lambda t: on_tick(worker, t)))
    return episodes(client, keys, GROUPS), worker


def test_abort_and_resume_reproduce_the_uninterrupted_run(client, keys, tiny_model_dir, engine_kind):
    from shared.keys import Keys

    plain, _ = _run(client, keys, _cfg(keys, tiny_model_dir, engine_kind))
    keys2 = Keys(keys.run + "b")
    cfg2 = _cfg(keys2, tiny_model_dir, engine_kind)
    rng = random.Random(3)
    pause_at = set(rng.sample(range(2, 35), 6))
    paused = []

    def interrupt(worker, tick):
        if tick in pause_at:
            send(client, keys2, "pause", sync=f"p{tick}")
            send(client, keys2, "resume", sync=f"r{tick}")
            paused.append(tick)

    resumed, _ = _run(client, keys2, cfg2, on_tick=interrupt)
    assert len(paused) >= 3
    assert len(acks(client, keys2, "pause")) == len(paused)
    total_aborts = 0
    for eid, ep in plain.items():
        other = resumed[eid]
        assert other.status == ep.status == "finished"
        assert other.tokens == ep.tokens
        assert other.logprobs == pytest.approx(ep.logprobs, abs=2e-4)
        total_aborts += len(other.aborts)
        # every resume continued exactly where the stream stood: no token written twice
        for ab, rs in zip(other.aborts, other.resumes):
            assert rs["num_tokens"] == ab["num_tokens"]
        assert len(other.tokens) == other.num_generated <= 40
    assert total_aborts >= 3


def test_versions_are_per_token_across_a_weight_reload(client, keys, tiny_model_dir, engine_kind, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    state = {k: (v + 0.01 * torch.randn_like(v)).contiguous() for k, v in model.state_dict().items()}
    path = tmp_path / "v1.safetensors"
    save_file(state, str(path))
    cfg = _cfg(keys, tiny_model_dir, engine_kind, max_tokens=30)
    loaded = []

    def reload(worker, tick):
        if tick == 8 and not loaded:
            send(client, keys, "pause")
            send(client, keys, "load", version=1, path=str(path))
            send(client, keys, "resume")
            loaded.append(tick)

    eps, worker = _run(client, keys, cfg, on_tick=reload)
    assert worker.engine.version == 1
    assert [a["ok"] for a in acks(client, keys, "load")] == ["1"]
    saw_both = False
    for ep in eps.values():
        assert ep.versions == sorted(ep.versions)  # never an old version after a new one
        assert set(ep.versions) <= {0, 1}
        if ep.aborts:
            cut = ep.aborts[0]["num_tokens"]
            assert set(ep.versions[:cut]) <= {0} and set(ep.versions[cut:]) <= {1}
            saw_both |= 0 < cut < len(ep.tokens)
    assert saw_both
