"""Routing replay (R3) in the trainer: the forward routes each sampled token through the experts the behaviour
policy chose, so fresh tokens' importance ratio is 1; the router still trains; a route that does not fit the model
is dead-lettered like any malformed entry; an MoE policy trains and publishes through the whole trainer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.trainer.batch import build_batch
from services.trainer.model import Policy
from services.trainer.step import StepConfig, policy_logprobs, train_on_batch
from services.trainer.trainer import Trainer
from shared.protocol.archive.ledger import read_ledger
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.episode.routes import RouteShape
from shared.protocol.streams import dead_letters
from shared.runtime import logs
from shared.runtime.config.keys import Config
from tests.support.arch_models import make_arch_model
from tests.support.moe_episodes import rollout, write_group


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_arch_model("qwen3-moe", tmp_path_factory.mktemp("qwen3-moe"))


def cfg_for(keys, model_dir, tmp_path, **kw) -> Config:
    return Config(
        run=keys.run,
        model_dir=model_dir,
        run_dir=str(tmp_path / "runs"),
        weights_dir=str(tmp_path / "w"),
        **{"batch_groups": 1, "lr": 1e-3, **kw},
    )


def batch_of(client, keys, eids, shape):
    episodes = [fold(EpisodeLog(client, keys, "r").read(eid)) for eid in eids]
    return build_batch([episodes], pad_id=0, route_shape=shape)


def test_fresh_tokens_have_an_importance_ratio_of_one_with_replay(client, keys, moe_dir, tmp_path):
    policy = Policy(cfg_for(keys, moe_dir, tmp_path))
    assert policy.route_shape == RouteShape(2, 2, 8)
    batch = batch_of(client, keys, write_group(client, keys, "g", rollout(moe_dir)), policy.route_shape)
    assert batch.routes is not None and int((batch.routes[..., 0, 0] >= 0).sum()) == batch.num_tokens
    with torch.no_grad():
        logp, _ = policy_logprobs(policy.model, batch, "cpu")
    mask = batch.loss_mask > 0
    assert float((logp[mask] - batch.behav_logp[mask]).abs().max()) < 1e-5


def test_the_forward_goes_through_the_logged_experts_and_the_router_still_trains(client, keys, moe_dir, tmp_path):
    policy = Policy(cfg_for(keys, moe_dir, tmp_path))
    batch = batch_of(client, keys, write_group(client, keys, "g", rollout(moe_dir, seed=7)), policy.route_shape)
    mask = batch.loss_mask > 0
    # other experts than the logged ones: the log-probs follow them
    moved = batch.routes.clone()
    held = moved >= 0
    moved[held] = (moved[held] + 3) % 8
    moved = moved.sort(dim=-1).values
    batch.routes, logged = moved, batch.routes
    with torch.no_grad():
        shifted, _ = policy_logprobs(policy.model, batch, "cpu")
    assert float((shifted[mask] - batch.behav_logp[mask]).abs().max()) > 1e-3
    batch.routes = logged
    logp, _ = policy_logprobs(policy.model, batch, "cpu")
    (-(logp * batch.loss_mask).sum()).backward()
    routers = policy.routers.modules
    assert all(r.weight.grad is not None and float(r.weight.grad.abs().sum()) > 0 for r in routers)


def test_with_replay_off_the_trainer_routes_itself(client, keys, moe_dir, tmp_path):
    policy = Policy(cfg_for(keys, moe_dir, tmp_path, routing_replay=False))
    assert policy.routers is None and policy.route_shape is None
    batch = batch_of(client, keys, write_group(client, keys, "g", rollout(moe_dir)), policy.route_shape)
    assert batch.routes is None


def test_an_moe_policy_trains_and_a_route_that_does_not_fit_is_dead_lettered(client, keys, moe_dir, tmp_path):
    cfg = cfg_for(keys, moe_dir, tmp_path, batch_groups=2)
    results = rollout(moe_dir)
    write_group(client, keys, "ok", results)
    # the first episode's routes name an expert the model does not have
    write_group(client, keys, "bad", results, routes_of=lambda i, r: np.where(r == r.max(), 9, r) if i == 0 else r)
    trainer = Trainer(cfg, client, logs.get("moe-test"))
    trainer.run(should_stop=lambda: trainer.version >= 1)
    letters = dead_letters.read_all(client, keys)
    assert {d.stream for d in letters} == {keys.episode("bad-0")}
    assert all("data.routes" in d.reason and "expert index 9" in d.reason for d in letters)
    records = read_ledger(cfg.run_path / "trainer")
    assert sorted(g for r in records for g in r["groups"]) == ["bad", "ok"]
    assert trainer.counts["episodes_failed"] == 1
    assert (cfg.weights_path / "v000001.safetensors").exists()


def test_the_step_reports_where_the_router_would_have_chosen_other_experts(client, keys, moe_dir, tmp_path):
    cfg = cfg_for(keys, moe_dir, tmp_path, lr=0.0)
    policy = Policy(cfg)
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)
    batch = batch_of(client, keys, write_group(client, keys, "g", rollout(moe_dir, seed=3)), policy.route_shape)
    fresh = train_on_batch(policy.model, opt, batch, StepConfig.from_config(cfg))
    assert fresh["route_mismatch"] == 0.0 and fresh["route_mismatch_by_staleness"] == {"0": 0.0}
    # logged routes the router would never choose: every replayed token moved
    held = batch.routes >= 0
    batch.routes[held] = ((batch.routes[held] + 3) % 8).to(torch.int16)
    batch.routes = batch.routes.sort(dim=-1).values
    moved = train_on_batch(policy.model, opt, batch, StepConfig.from_config(cfg))
    assert moved["route_mismatch"] == 1.0


def test_a_models_own_load_balancing_loss_keeps_training_under_replay(client, keys, moe_dir, tmp_path):
    import json
    from pathlib import Path

    balanced = tmp_path / "balanced"
    import shutil

    shutil.copytree(moe_dir, balanced)
    config = json.loads(Path(balanced, "config.json").read_text())
    Path(balanced, "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    cfg = cfg_for(keys, str(balanced), tmp_path)
    policy = Policy(cfg)
    batch = batch_of(client, keys, write_group(client, keys, "g", rollout(moe_dir, seed=5)), policy.route_shape)
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)
    stats = train_on_batch(policy.model, opt, batch, StepConfig.from_config(cfg))
    assert stats["router_aux_loss"] > 0 and stats["route_mismatch"] == 0.0
    plain = Policy(cfg_for(keys, moe_dir, tmp_path))
    assert "router_aux_loss" not in train_on_batch(plain.model, opt, batch, StepConfig.from_config(cfg))
