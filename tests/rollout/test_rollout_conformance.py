"""The engine contract as the rollout worker relies on it, run for every engine.

The vLLM adapter runs these same tests (its parameter is skipped when vllm is
not importable; CI runs it in its own venv with the CPU build). Everything is
real: Redis, the model, the worker loop. Both engines run the same tiny model
(head size 32: the smallest vLLM's CPU attention accepts). The torch engine is
built per worker (cheap); vLLM is started once for the module and put back to
the version-0 weights before each test.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from services.trainer.batch import build_batch
from services.trainer.objective.corrections import mismatch
from services.trainer.step import policy_logprobs
from shared.protocol.keys import Keys
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from shared.runtime.weights.checksum import sha256_file
from tests.support.rollout_harness import acks, episodes, make_vllm_engine, make_worker, samples, send, tick_until

ENGINES = [
    "torch",
    pytest.param(
        "vllm",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("vllm") is None, reason="vllm not installed (CI runs it in its own venv)"
        ),
    ),
]

GROUPS = [("ga", 3), ("gb", 2)]

# Behaviour log-probs vs the trainer's recomputation (HF forward, same weights, float32):
# the torch engine runs the HF model itself (batched, KV-cached); vLLM has its own kernels
# (CPU paged attention, fused qkv / gate_up). Measured on the tiny model: torch <= 3e-6 max,
# vLLM CPU float32 about 1e-6 max (see the printed line). A wrong version, stale
# prefix cache or temperature shows up as 1e-1 or more.
TRAINER_LOGPROB_TOL = {"torch": 1e-4, "vllm": 1e-3}


@pytest.fixture(params=ENGINES)
def engine_kind(request):
    return request.param


@pytest.fixture
def model_dir(tiny_model_dir_hd32):
    return tiny_model_dir_hd32


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir_hd32):
    engine = make_vllm_engine(tiny_model_dir_hd32)
    yield engine
    engine.close()


@pytest.fixture
def engine(engine_kind, request, model_dir):
    """None for torch (each worker builds its own); vLLM: the module's engine at version 0."""
    if engine_kind == "torch":
        return None
    engine = request.getfixturevalue("vllm_engine")
    engine.abort_all()
    if engine.version != 0:
        engine.load_weights(model_dir, 0)
    return engine


def _cfg(keys, model_dir, engine_kind, **kw) -> Config:
    base = dict(
        run=keys.run,
        model_dir=model_dir,
        engine=engine_kind,
        max_tokens=40,
        tools="",
        temperature=1.0,
        flush_tokens=4,
        flush_ms=1000.0,
        heartbeat_ttl=2.0,
    )
    return Config(**{**base, **kw})


def _enqueue(client, keys, prompt="{g}: 12+7="):
    enqueue(client, keys, [PromptGroup(g, n, prompt=prompt.format(g=g)) for g, n in GROUPS])


def _run(client, keys, cfg, engine=None, on_tick=None, prompt="{g}: 12+7="):
    _enqueue(client, keys, prompt)
    worker = make_worker(cfg, client, engine=engine)
    tick_until(
        worker, lambda: len(samples(client, keys)) == len(GROUPS), on_tick=on_tick and (lambda t: on_tick(worker, t))
    )
    return episodes(client, keys, GROUPS), worker


def test_abort_and_resume_reproduce_the_uninterrupted_run(client, keys, model_dir, engine_kind, engine):
    # The torch engine's sampling is a pure function of (seed, position), so a sampled run
    # resumes into exactly the tokens of the uninterrupted one. vLLM's seeded generator is
    # not position-addressed (a resumed request cannot redraw what the uninterrupted run
    # drew), so for vLLM the bar is greedy: the same tokens, aborted or not.
    temperature = 1.0 if engine_kind == "torch" else 0.0
    plain, _ = _run(client, keys, _cfg(keys, model_dir, engine_kind, temperature=temperature), engine)
    keys2 = Keys(keys.run + "b")
    cfg2 = _cfg(keys2, model_dir, engine_kind, temperature=temperature)
    rng = random.Random(3)
    pause_at = set(rng.sample(range(2, 35), 6))
    paused = []

    def interrupt(worker, tick):
        if tick in pause_at:
            send(client, keys2, "pause", sync=f"p{tick}")
            send(client, keys2, "resume", sync=f"r{tick}")
            paused.append(tick)

    resumed, _ = _run(client, keys2, cfg2, engine, on_tick=interrupt)
    assert len(paused) >= 3
    assert len(acks(client, keys2, "pause")) == len(paused)
    total_aborts = 0
    for eid, ep in plain.items():
        other = resumed[eid]
        assert other.status == ep.status == "finished"
        assert other.tokens == ep.tokens
        # a resume re-prefills prompt + tokens so far: same math, another kernel path
        assert other.logprobs == pytest.approx(ep.logprobs, abs=2e-4)
        total_aborts += len(other.aborts)
        # every resume continued exactly where the stream stood: no token written twice
        for ab, rs in zip(other.aborts, other.resumes):
            assert rs["num_tokens"] == ab["num_tokens"]
        assert len(other.tokens) == other.num_generated <= 40
    assert total_aborts >= 3


def test_versions_are_per_token_across_a_weight_reload(client, keys, model_dir, engine_kind, engine, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    state = {k: (v + 0.01 * torch.randn_like(v)).contiguous() for k, v in model.state_dict().items()}
    path = tmp_path / "v1.safetensors"
    save_file(state, str(path))
    cfg = _cfg(keys, model_dir, engine_kind, max_tokens=30)
    loaded = []

    def reload(worker, tick):
        if tick == 8 and not loaded:
            send(client, keys, "pause")
            send(client, keys, "load", version=1, path=str(path))
            send(client, keys, "resume")
            loaded.append(tick)

    eps, worker = _run(client, keys, cfg, engine, on_tick=reload)
    assert worker.engine.version == 1
    assert [a["ok"] for a in acks(client, keys, "load")] == ["1"]
    saw_both = False
    for ep in eps.values():
        # never an old version after a new one
        assert ep.versions == sorted(ep.versions)
        assert set(ep.versions) <= {0, 1}
        if ep.aborts:
            cut = ep.aborts[0]["num_tokens"]
            assert set(ep.versions[:cut]) <= {0} and set(ep.versions[cut:]) <= {1}
            saw_both |= 0 < cut < len(ep.tokens)
    assert saw_both


def _recompute(model, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of every generated token (its own code path: batch rows, forward, the shared
    log-prob under each episode's sampling params from its ``started`` event), and the engine's, flattened."""
    mine, theirs = [], []
    with torch.no_grad():
        for ep in eps.values():
            logp, _ = policy_logprobs(model, build_batch([[ep]], pad_id=0), "cpu")
            start = len(ep.prompt_ids) - 1
            mine.append(logp[0, start : start + len(ep.tokens)])
            theirs.append(torch.tensor(ep.logprobs))
    return torch.cat(mine), torch.cat(theirs)


SAMPLINGS = {
    "t0.8": {"temperature": 0.8},
    "t0.7-top_p0.9-top_k10": {"temperature": 0.7, "top_p": 0.9, "top_k": 10},
    "greedy": {"temperature": 0.0},
}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_logprobs_agree_with_the_trainer_under_the_same_weights(
    client, keys, model_dir, engine_kind, engine, tmp_path, sampling, record_property
):
    """Run under version 0, publish version 1 (checksummed), run the same prompts again:
    each run's behaviour log-probs match the trainer's recomputation under its own
    weights, for plain temperature, top-k + top-p, and greedy (one-hot: log-prob 0). The prompt
    spans several KV blocks, so prefixes cached under version 0 would be reused under version 1
    if the engine kept its prefix cache."""
    prompt = "{g}: " + "12+7=19; 3*4=12; " * 4 + "5+6="
    params = SAMPLINGS[sampling]
    cfg = _cfg(keys, model_dir, engine_kind, max_tokens=24, **params)
    v0_eps, _ = _run(client, keys, cfg, engine, prompt=prompt)

    base = load_file(str(Path(model_dir) / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    v1 = {k: (v + 0.05 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in base.items()}
    path = tmp_path / "v000001.safetensors"
    save_file(v1, str(path))
    keys2 = Keys(keys.run + "v1")
    client.xadd(keys2.versions, {"version": "1", "path": str(path), "sha256": sha256_file(path), "step": "1"})
    v1_eps, worker = _run(
        client, keys2, _cfg(keys2, model_dir, engine_kind, max_tokens=24, **params), engine, prompt=prompt
    )
    assert worker.engine.version == 1
    assert all(set(ep.versions) == {1} for ep in v1_eps.values())

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    trainer0, engine0 = _recompute(model, v0_eps)
    model.load_state_dict(v1)
    trainer1, engine1 = _recompute(model, v1_eps)
    stale = (_recompute(AutoModelForCausalLM.from_pretrained(model_dir).eval(), v1_eps)[0] - engine1).abs()
    d0, d1 = (trainer0 - engine0).abs(), (trainer1 - engine1).abs()
    print(
        f"\n{engine_kind} {sampling}: behaviour vs trainer log-prob |diff| over {len(d0) + len(d1)} tokens: "
        f"max {max(d0.max(), d1.max()):.2e}, mean {torch.cat([d0, d1]).mean():.2e} "
        f"(v1 tokens scored with the v0 weights: max {stale.max():.2e})"
    )
    tol = TRAINER_LOGPROB_TOL[engine_kind]
    assert d0.max() < tol and d1.max() < tol
    # the engine mismatch as the trainer reports it every batch (mismatch_kl: tokens of its own current version)
    trainer_lp, engine_lp = torch.cat([trainer0, trainer1]), torch.cat([engine0, engine1])
    kl = mismatch(
        trainer_lp,
        engine_lp,
        torch.ones_like(trainer_lp, dtype=torch.bool),
        torch.zeros_like(trainer_lp, dtype=torch.long),
        trainer_version=0,
    )["mismatch_kl"]
    record_property("figure", f"mismatch_kl {engine_kind} {sampling}: {kl:.3e} over {len(trainer_lp)} tokens")
    # k3 ≈ d²/2 for small d
    assert 0.0 <= kl <= tol**2
    if sampling == "greedy":
        # the argmax has probability 1
        assert engine0.abs().max() == engine1.abs().max() == 0.0
    else:
        # the comparison can tell the two versions apart
        assert stale.max() > 100 * tol
