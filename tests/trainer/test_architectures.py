"""The pipeline's pieces on tiny random-init Llama, Qwen2 (tied embeddings) and Mistral models with BPE
tokenizers and ChatML templates: torch-engine rollout of a chat prompt until a stop id, one trainer step that
publishes a version (plain, LoRA, bf16 + checkpointing + KL), the engine loading it, export, reload, generate."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.rollout.engine import EngineError, SamplingParams
from services.rollout.engine.torch_engine import TorchEngine
from services.trainer.export import export_version
from services.trainer.trainer import Trainer
from shared.protocol.episode.log import EpisodeLog
from shared.runtime import logs
from shared.runtime.config.keys import Config
from shared.runtime.prompt_format import encode_prompt, stop_token_ids
from tests.support.arch_models import make_arch_model

CHAT = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "3+4="}]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def arch(request, tmp_path_factory):
    return request.param, make_arch_model(request.param, tmp_path_factory.mktemp(request.param))


def _rollout(engine: TorchEngine, prompt_ids: list[int], stops: tuple[int, ...], n: int = 3, max_tokens: int = 8):
    for i in range(n):
        engine.add_request(
            f"r{i}",
            prompt_ids,
            SamplingParams(temperature=1.0, seed=i, stop_token_ids=stops, max_tokens=max_tokens),
            max_tokens,
        )
    out: dict[str, tuple[list[int], list[float]]] = {f"r{i}": ([], []) for i in range(n)}
    while engine.has_unfinished():
        for chunk in engine.step():
            out[chunk.request_id][0].extend(chunk.token_ids)
            out[chunk.request_id][1].extend(chunk.logprobs)
    return out


def _write_group(client, keys, group_id, prompt_ids, results, version=0):
    log = EpisodeLog(client, keys, "writer")
    eids = []
    for i, (toks, lps) in enumerate(results.values()):
        eid = f"{group_id}-{i}"
        eids.append(eid)
        log.open(eid)
        log.append(
            eid,
            "started",
            {
                "episode_id": eid,
                "group_id": group_id,
                "index": i,
                "prompt_ids": prompt_ids,
                "sampling": {"temperature": 1.0},
                "task": {},
            },
            version,
        )
        log.append_tokens(eid, toks, lps, version)
        log.append(eid, "finished", {"reason": "stop", "reward": float(i == 0)}, version)
    log.flush_or_raise()
    client.xadd(
        keys.samples, {"group_id": group_id, "episodes": ",".join(eids), "worker": "writer", "n": str(len(eids))}
    )


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2},
        {"dtype": "bfloat16", "grad_checkpointing": True, "kl_coef": 0.1},
    ],
    ids=["full", "lora", "bf16-ckpt-kl"],
)
def test_rollout_train_publish_export_reload(arch, variant, client, keys, tmp_path):
    kind, model_dir = arch
    tok = AutoTokenizer.from_pretrained(model_dir)
    stops = stop_token_ids(tok, model_dir)
    assert set(stops) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    prompt_ids = encode_prompt(tok, CHAT)
    assert prompt_ids.count(tok.bos_token_id) == (1 if kind == "llama" else 0) or tok.bos_token_id is None
    engine = TorchEngine(model_dir, max_batch_size=4)
    results = _rollout(engine, prompt_ids, stops)
    assert all(0 < len(t) <= 8 for t, _ in results.values())
    # each ends at a stop id or at the budget
    for toks, _ in results.values():
        assert len(toks) == 8 or toks[-1] in stops

    cfg = Config(
        run=keys.run,
        model_dir=model_dir,
        run_dir=str(tmp_path / "runs"),
        weights_dir=str(tmp_path / "w"),
        **{"batch_groups": 2, "lr": 1e-3, **variant},
    )
    _write_group(client, keys, "a", prompt_ids, results)
    _write_group(client, keys, "b", prompt_ids, _rollout(engine, prompt_ids, stops))
    trainer = Trainer(cfg, client, logs.get("arch-test"))
    if variant.get("lora_rank"):
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        assert 0 < trainable < 0.5 * sum(p.numel() for p in trainer.model.parameters())
    trainer.run(should_stop=lambda: trainer.version >= 1)
    published = load_file(str(cfg.weights_path / "v000001.safetensors"))
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(published) <= set(initial) and all(published[k].shape == initial[k].shape for k in published)
    # the step changed the weights
    assert any(not torch.equal(published[k], initial[k]) for k in published)
    if variant.get("kl_coef"):
        import json

        assert "kl" in json.loads((cfg.run_path / "metrics.jsonl").read_text().splitlines()[0])
    # merged LoRA / tied: loads as-is
    engine.load_weights(str(cfg.weights_path / "v000001.safetensors"), 1)
    assert all(len(t) > 0 for t, _ in _rollout(engine, prompt_ids, stops, n=2).values())

    out = export_version(cfg, 1)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    reloaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    state = reloaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in published.items())
    tok2 = AutoTokenizer.from_pretrained(str(out))
    assert encode_prompt(tok2, CHAT) == prompt_ids and stop_token_ids(tok2, str(out)) == stops
    ids = torch.tensor([prompt_ids])
    gen = reloaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > ids.shape[1]


def test_a_sliding_window_model_is_refused_at_engine_start(tmp_path):
    model_dir = make_arch_model("mistral-sliding", tmp_path / "m")
    with pytest.raises(EngineError, match="cannot serve.*DynamicSlidingWindowLayer.*sliding_window=32"):
        TorchEngine(model_dir)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_sliding_windows_are_one_line_naming_the_config_values_that_work(kind):
    """Gemma 2/3 slide on some layers; the old advice (sliding_window: null) crashed inside transformers with a raw
    TypeError. Each refusal is one EngineError naming what works, and what it names does work."""
    from transformers import Gemma2Config, Gemma3TextConfig

    from services.rollout.engine.model_runner import ModelRunner

    make = {"gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}[kind]
    dims = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=64,
    )
    for config in (make(**dims), make(**{**dims, "sliding_window": None})):
        with pytest.raises(EngineError) as err:
            ModelRunner._check_servable(config, "m")
        assert len(str(err.value).splitlines()) == 1
        assert '"layer_types" to "full_attention" for every layer' in str(err.value) and "vllm" in str(err.value)
    # what it names: served
    ModelRunner._check_servable(make(**dims, layer_types=["full_attention"] * 2), "m")
