"""bench/moe/routing.py's pieces: the offline loop trains on batches the torch engine sampled at version v − η with
routes, its probes measure replay on and off on the same batch without changing the model, and the routes' bytes are
their wire form's."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.learning.staleness_cell import Setup  # noqa: E402
from bench.moe.replay_cell import Replay, make_engine, measure, run_cell, sample_engine, set_replay  # noqa: E402
from services.ops.launch.default_model import DEFAULT_MODEL  # noqa: E402
from services.ops.launch.tiny_model import load_tokenizer, make_tiny_model  # noqa: E402
from services.trainer.step import StepConfig  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.moe.routers import Routers  # noqa: E402

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((3, 4), (1, 2), (5, 5))]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe") / "m"
    # the default MoE model's shape, random init
    make_tiny_model(d, **DEFAULT_MODEL, seed=0, moe="qwen3")
    return str(d)


def setup(**kw) -> Setup:
    return Setup.from_defaults(**{"steps": 4, "batch_groups": 1, "group_size": 2, "max_tokens": 6, **kw})


def test_batches_come_from_version_v_minus_eta_and_probes_measure_each_eta(moe_model):
    cell = run_cell(moe_model, 2, Replay(True), 0, setup(), ROWS, probe_every=1, probe_groups=1, probe_etas=(0, 1))
    assert cell["behaviour_versions"] == [0, 0, 0, 1]
    # from version 2 (the largest of η and the probed η: their snapshots exist) on, every version
    assert [p["version"] for p in cell["probes"]] == [2, 3]
    fresh = [p["0"]["replay"] for p in cell["probes"]]
    assert all(f["route_mismatch"] == 0.0 and f["max_abs_log_ratio"] < 1e-5 for f in fresh)
    assert all(r is not None for r in cell["route_mismatch"])


def test_a_probe_changes_nothing_and_replay_off_routes_freely(moe_model):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(moe_model)
    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    routers = Routers.of(model)
    engine = make_engine(moe_model, "float32", 8)
    groups = sample_engine(engine, tok, ROWS, 2, setup(), seed=1)
    assert all(len(ep.routes) == len(ep.tokens) for g in groups for ep in g)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([groups[0][0].prompt_ids + groups[0][0].tokens])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    # logged routes the router would never choose: the replayed forward moves every token, the free one none
    for ep in (ep for g in groups for ep in g):
        ep.routes = [np.sort((r + 3) % 8, axis=-1).astype(np.uint8) for r in ep.routes]
    sc = StepConfig.from_config(Config())
    on = measure(model, routers, groups, tok.pad_token_id, 0, sc, True)
    off = measure(model, routers, groups, tok.pad_token_id, 0, sc, False)
    assert on["route_mismatch"] == 1.0 and on["max_abs_log_ratio"] > 1e-3
    assert off["route_mismatch"] is None and off["max_abs_log_ratio"] < 1e-5
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    set_replay(model, routers, False)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain)


def test_routes_cost_their_wire_form_before_compression(moe_model):
    from bench.moe.route_bytes import measure as route_bytes

    tok = load_tokenizer(moe_model)
    engine = make_engine(moe_model, "float32", 8)
    groups = sample_engine(engine, tok, ROWS, 2, setup(), seed=2)
    b = route_bytes([ep for g in groups for ep in g], engine.route_shape)
    # one byte per expert index: 2 MoE layers x top-2
    assert b["wire_per_token"] == 4.0 and b["wire_per_token_per_layer"] == 2.0
    assert b["with_routes"]["entry_per_token"] > b["without_routes"]["entry_per_token"]
