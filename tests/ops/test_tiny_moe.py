"""The default tiny model as a mixture of experts (`streamrl make-model --moe`, config key model_moe): each family is
made locally, loads as its transformers MoE class, generates, is recorded under its own recipe (so a run wanting
another family remakes it), and its routing shape is what a run records."""

from __future__ import annotations

import json

import pytest

from services.ops.cli.main import main
from services.ops.launch import default_model, preflight, tiny_model
from services.ops.launch.runner import check_continuation
from shared.runtime import runstate
from shared.runtime.config.checks import MOE_FAMILIES, validate
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config

# family -> the transformers class
CLASSES = {"qwen3": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}


def test_every_family_the_config_accepts_can_be_made():
    assert set(CLASSES) == set(MOE_FAMILIES) == set(tiny_model.MOE_NAMES)


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_make_model_moe_makes_that_family_which_loads_and_generates(family, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tiny"
    assert main(["make-model", "--moe", family, "--model-dir", str(out), "--warm-steps", "3"]) == 0
    err = capsys.readouterr().err
    assert f"random-init 2-layer {tiny_model.MOE_NAMES[family]} (8 experts, top-2) + 3 supervised" in err
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(model).__name__ == CLASSES[family]
    # (each family's config maps num_experts to its own field)
    assert model.config.num_experts == 8 and model.config.num_experts_per_tok == 2
    assert model.config.output_router_logits is False
    # a token's active MLP parameters are the dense model's: top-2 of 8 experts each half the dense MLP's width
    experts = model.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // 8
    dense = 3 * default_model.DEFAULT_MODEL["hidden_size"] * default_model.DEFAULT_MODEL["intermediate_size"]
    assert 2 * per_expert == dense
    tok = tiny_model.load_tokenizer(out)
    ids = torch.tensor([tok.encode("12+7=", add_special_tokens=False)])
    with torch.inference_mode():
        made = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert made.shape == (1, ids.shape[1] + 4) or int(made[0, -1]) in model.generation_config.eos_token_id
    recipe = json.loads((out / default_model.RECIPE_FILE).read_text())
    dense_recipe = default_model.default_recipe(Config(), warm_steps=3)
    assert recipe == {**dense_recipe, "moe": family} and "moe" not in dense_recipe
    assert runstate.model_shape(str(out)) == {"moe": True, "layers": 2, "top_k": 2, "experts": 8}
    # `streamrl run` takes it: it loads, the torch engine can serve it, the task's prompts fit
    assert preflight.problems(Config(model_dir=str(out), run_dir=str(tmp_path / "runs"))) == []


def test_a_run_wanting_the_dense_model_remakes_an_moe_one_and_back(tmp_path, capsys):
    model_dir = str(tmp_path / "tiny")
    assert default_model.ensure_default_model(Config(model_dir=model_dir, model_moe="mixtral"), warm_steps=0)
    # a run takes whatever warm start make-model was given, of its own family
    assert not default_model.ensure_default_model(Config(model_dir=model_dir, model_moe="mixtral"))
    assert default_model.ensure_default_model(Config(model_dir=model_dir), warm_steps=0)
    assert "remaking it" in capsys.readouterr().err
    assert runstate.model_shape(model_dir) == {"moe": False}
    assert default_model.ensure_default_model(Config(model_dir=model_dir, model_moe="olmoe"), warm_steps=0)
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["model_type"] == "olmoe"


def test_model_moe_is_one_of_the_families():
    validate(Config(model_moe="qwen3"))
    with pytest.raises(ConfigError) as exc:
        validate(Config(model_moe="deepseek"))
    assert str(exc.value) == (
        "config key 'model_moe': expected 'qwen3', 'mixtral', 'olmoe' or '' (the dense default model), got 'deepseek'"
    )


def test_an_interrupted_run_on_the_dense_default_model_is_not_remade_as_moe_under_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # recorded before model_moe was a key: made on the dense model
    recorded = {k: v for k, v in runstate.recordable(Config()).items() if k != "model_moe"}
    runstate.write_marker(
        tmp_path / "runs" / "demo",
        {"run": "demo", "id": "abc", "created": "t", "config": json.dumps(recorded)},
        "redis://127.0.0.1:1/0",
    )
    cfg = Config(run="demo", run_dir="runs")
    check_continuation(cfg)
    with pytest.raises(ConfigError) as exc:
        check_continuation(cfg.replace(model_moe="qwen3"))
    assert "it was made on the default model for" in str(exc.value) and "'moe': 'qwen3'" in str(exc.value)
