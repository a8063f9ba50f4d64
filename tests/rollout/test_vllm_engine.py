"""The vLLM adapter: selection and its errors (main suite, where vllm is absent),
and the adapter's own behaviour on a real vLLM (CI's vLLM step, CPU build)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.rollout.engine import EngineError, SamplingParams, make_engine
from services.rollout.engine.vllm_engine import parse_vllm_args, request_seed
from shared.runtime.config.checks import validate
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from tests.support.rollout_harness import VLLM_TEST_ARGS

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm not installed (CI runs it in its own venv)")


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is installed here")
def test_selecting_vllm_without_vllm_names_the_install(tiny_model_dir):
    with pytest.raises(
        EngineError, match=r"engine 'vllm' selected but vllm is not installed: pip install '\.\[vllm\]'"
    ):
        make_engine("vllm", tiny_model_dir)


def test_unknown_engine_is_refused(tiny_model_dir):
    with pytest.raises(EngineError, match="unknown engine 'tgi'"):
        make_engine("tgi", tiny_model_dir)


def test_vllm_args_reach_only_vllm(tiny_model_dir):
    engine = make_engine("torch", tiny_model_dir, vllm_args='{"dtype": "float32"}', max_batch_size=2)
    assert engine.version == 0


def test_vllm_args_config_key_must_be_a_json_object():
    validate(Config(vllm_args='{"gpu_memory_utilization": 0.8}'))
    with pytest.raises(ConfigError, match="config key 'vllm_args': expected a JSON object"):
        validate(Config(vllm_args="[1, 2]"))
    with pytest.raises(ConfigError, match="config key 'vllm_args'"):
        validate(Config(vllm_args="dtype=float32"))
    assert parse_vllm_args('{"dtype": "float32"}') == {"dtype": "float32"}
    assert parse_vllm_args("") == {}
    with pytest.raises(EngineError, match="vllm_args: expected a JSON object"):
        parse_vllm_args("3")


def test_request_seed_depends_on_seed_and_resume_position():
    seeds = {request_seed(s, k) for s in range(20) for k in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert request_seed(7, 3) == request_seed(7, 3)


# --- on a real vLLM -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm(tiny_model_dir_hd32):
    if not HAVE_VLLM:
        pytest.skip("vllm not installed (CI runs it in its own venv)")
    # routing_replay on, as the config's default is: a dense model ignores it
    engine = make_engine("vllm", tiny_model_dir_hd32, max_batch_size=4, vllm_args=VLLM_TEST_ARGS, routing_replay=True)
    yield engine
    engine.close()


def _drain(engine) -> dict[str, list]:
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for c in engine.step():
            entry = out.setdefault(c.request_id, [[], [], None, set()])
            entry[0] += c.token_ids
            entry[1] += c.logprobs
            entry[2] = c.finish_reason
            entry[3].add(c.version)
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@needs_vllm
def test_a_head_size_the_cpu_build_cannot_serve_is_refused_up_front(tiny_model_dir):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size check is the CPU build's")
    with pytest.raises(EngineError, match=r"attention head size 16; vLLM's CPU attention supports \[32, "):
        # the default tiny model: hidden 64, 4 heads
        make_engine("vllm", tiny_model_dir)


@needs_vllm
def test_generation_abort_and_continuation(vllm):
    prompt = [1, 20, 21, 22, 23]
    vllm.add_request("full", prompt, GREEDY, 12)
    full = _drain(vllm)["full"]
    assert full[2] == "length" and len(full[0]) == 12 == len(full[1])
    assert all(lp <= 0 for lp in full[1])
    vllm.add_request("cut", prompt, GREEDY, 12)
    got = []
    for _ in range(3):
        for c in vllm.step():
            got += c.token_ids
    rest = vllm.abort("cut")
    # in-process: every token was returned
    assert rest.finish_reason == "abort" and rest.token_ids == []
    assert not vllm.has_unfinished() and vllm.abort("cut") is None
    assert 0 < len(got) < 12 and got == full[0][: len(got)]
    vllm.add_request("cut", prompt + got, GREEDY, 12 - len(got), start_index=len(got))
    cont = _drain(vllm)["cut"]
    assert got + cont[0] == full[0]
    assert full[1][len(got) :] == pytest.approx(cont[1], abs=2e-4)


@needs_vllm
def test_stop_tokens_and_bad_requests(vllm):
    prompt = [1, 20, 21, 22, 23]
    vllm.add_request("a", prompt, GREEDY, 10)
    first = _drain(vllm)["a"][0]
    stop = first[3]
    vllm.add_request("a", prompt, SamplingParams(temperature=0.0, stop_token_ids=(stop,)), 10)
    out = _drain(vllm)["a"]
    # the stop token is kept
    assert out[2] == "stop" and out[0][-1] == stop and stop not in out[0][:-1]
    vllm.add_request("b", prompt, GREEDY, 5)
    with pytest.raises(EngineError, match="already in the engine"):
        vllm.add_request("b", prompt, GREEDY, 5)
    assert [c.finish_reason for c in vllm.abort_all()] == ["abort"]
    with pytest.raises(EngineError, match="leaves no room"):
        vllm.add_request("c", [5] * vllm.max_model_len, GREEDY, 5)
    with pytest.raises(EngineError, match="bad sampling params"):
        vllm.add_request("c", prompt, SamplingParams(top_p=0.0), 5)
    with pytest.raises(EngineError, match="max_new_tokens must be >= 1"):
        vllm.add_request("c", prompt, GREEDY, 0)
    assert not vllm.has_unfinished()


@needs_vllm
def test_weight_loads_tag_versions_and_bad_weights_keep_the_old(vllm, tiny_model_dir_hd32, tmp_path):
    prompt = [1, 40, 41, 42]
    vllm.add_request("v0", prompt, GREEDY, 10)
    v0 = _drain(vllm)["v0"]
    base = load_file(f"{tiny_model_dir_hd32}/model.safetensors")
    gen = torch.Generator().manual_seed(0)
    v1 = {k: (v + 0.2 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in base.items()}
    save_file(v1, str(tmp_path / "v1.safetensors"))
    vllm.add_request("busy", prompt, GREEDY, 10)
    with pytest.raises(EngineError, match="while requests are in flight"):
        vllm.load_weights(str(tmp_path / "v1.safetensors"), 1)
    vllm.abort_all()
    vllm.load_weights(str(tmp_path / "v1.safetensors"), 1)
    vllm.add_request("v1", prompt, GREEDY, 10)
    out1 = _drain(vllm)["v1"]
    assert out1[3] == {1} and out1[0] != v0[0]

    broken = dict(v1)
    broken["model.embed_tokens.weight"] = broken["model.embed_tokens.weight"][:, :64].contiguous()
    save_file(broken, str(tmp_path / "bad.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for bad, why in [
        ("bad.safetensors", "do not fit the model: shape of 'model.embed_tokens.weight'"),
        ("junk.safetensors", "cannot read weights"),
        ("nothing-here", "no safetensors weights"),
    ]:
        with pytest.raises(EngineError, match=why):
            vllm.load_weights(str(tmp_path / bad), 2)
    assert vllm.version == 1
    vllm.add_request("still-v1", prompt, GREEDY, 10)
    # the refused loads left the weights untouched
    assert _drain(vllm)["still-v1"][0] == out1[0]
    # a model folder works as well as a file
    vllm.load_weights(tiny_model_dir_hd32, 0)
    vllm.add_request("v0-again", prompt, GREEDY, 10)
    assert _drain(vllm)["v0-again"][0] == v0[0]


# --- a mixture of experts: routing replay refused, the model served without it ---------------------------------


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> str:
    """A random-init Qwen3-MoE (2 MoE layers, top-2 of 8 experts, head size 32 for the CPU attention) with the
    project's tiny tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from services.ops.launch.tiny_model import build_tokenizer

    tok = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-moe")
    Qwen3MoeForCausalLM(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


@needs_vllm
def test_the_dense_model_records_no_routes(vllm):
    assert vllm.route_shape is None
    vllm.add_request("dense", [1, 20, 21], GREEDY, 3)
    chunks = []
    while vllm.has_unfinished():
        chunks += vllm.step()
    assert chunks and all(c.routes is None for c in chunks)


@needs_vllm
def test_routing_replay_on_a_moe_model_is_refused_in_one_line(tiny_moe_dir):
    import vllm as vllm_module

    with pytest.raises(EngineError) as err:
        make_engine("vllm", tiny_moe_dir, vllm_args=VLLM_TEST_ARGS, routing_replay=True)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("routing replay needs each sampled token's expert routes from the engine")
    assert "(2 MoE layers, top-2 of 8 experts)" in message
    assert f"vLLM {vllm_module.__version__} returns routed experts for a request's finished output only" in message
    assert message.endswith("set routing_replay = false, or engine = 'torch'")


@needs_vllm
@pytest.mark.slow(seconds=20)
def test_a_moe_model_without_routing_replay_samples_what_transformers_does(tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    prompt = [1, 20, 21, 22, 23]
    # its engine core in its own process: vLLM's in-process parallel state is the dense fixture's, without the
    # expert-parallel group a MoE model needs
    args = json.loads(VLLM_TEST_ARGS) | {"multiprocessing": True}
    engine = make_engine("vllm", tiny_moe_dir, max_batch_size=2, vllm_args=args, routing_replay=False)
    try:
        assert engine.route_shape is None
        engine.add_request("moe", prompt, GREEDY, 8)
        out = _drain(engine)["moe"]
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    assert out[2] == "length" and out[0] == want
