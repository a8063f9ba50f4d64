"""Which models are mixtures of experts and the shape of their routes, read from real transformers configs."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

from shared.protocol.episode.routes import RouteShape
from shared.runtime.moe.shape import moe_layers, route_shape_of


def test_qwen3_moe_counts_only_its_sparse_layers():
    every = Qwen3MoeConfig(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)
    assert route_shape_of(every) == RouteShape(layers=4, top_k=2, experts=8)
    # every second layer sparse (layers 1 and 3 of 0..5), and layer 3 forced dense: layers 1 and 5 remain
    mixed = Qwen3MoeConfig(
        num_hidden_layers=6, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    assert moe_layers(mixed) == (1, 5)
    assert route_shape_of(mixed) == RouteShape(layers=2, top_k=4, experts=16)


def test_qwen3_moe_without_experts_is_dense():
    assert route_shape_of(Qwen3MoeConfig(num_hidden_layers=2, num_experts=0)) is None


def test_mixtral_reads_num_local_experts():
    cfg = MixtralConfig(num_hidden_layers=3, num_local_experts=6, num_experts_per_tok=2)
    assert route_shape_of(cfg) == RouteShape(layers=3, top_k=2, experts=6)


def test_olmoe_and_more_than_256_experts_widen_the_dtype():
    cfg = OlmoeConfig(num_hidden_layers=2, num_experts=300, num_experts_per_tok=8)
    shape = route_shape_of(cfg)
    assert shape == RouteShape(layers=2, top_k=8, experts=300)
    assert shape.dtype.itemsize == 2


def test_a_dense_llama_has_no_routes():
    cfg = LlamaConfig(num_hidden_layers=2)
    assert route_shape_of(cfg) is None
    assert moe_layers(cfg) == ()


def test_a_config_json_dict_reads_like_the_config_object(tmp_path):
    cfg = Qwen3MoeConfig(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2)
    cfg.save_pretrained(tmp_path)
    as_dict = json.loads((tmp_path / "config.json").read_text())
    assert route_shape_of(as_dict) == route_shape_of(cfg) == RouteShape(layers=2, top_k=2, experts=8)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_experts": -1}, "num_experts"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"mlp_only_layers": "0"}, "mlp_only_layers"),
    ],
)
def test_a_malformed_moe_config_names_its_field(patch, field):
    cfg = {"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2} | patch
    with pytest.raises(ValueError, match=f"field '{field}'") as err:
        route_shape_of(cfg)
    assert "\n" not in str(err.value)


def test_deepseek_style_dense_first_layers_and_a_nested_text_config():
    moe = {"num_hidden_layers": 4, "n_routed_experts": 8, "num_experts_per_tok": 2}
    assert route_shape_of({**moe, "first_k_dense_replace": 1}).to_dict() == {"layers": 3, "top_k": 2, "experts": 8}
    assert route_shape_of({"text_config": moe, "model_type": "some_vlm"}).layers == 4
