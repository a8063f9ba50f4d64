"""One training run of the routing-replay benchmark (bench/moe/routing.py): the tiny Qwen3-MoE default model trained
offline at staleness exactly η, its batches sampled by the torch engine at version v − η with routes logged, the
trainer's own ``build_batch`` + ``train_on_batch``, with routing replay on or off; and every few versions a probe of
each η: a batch sampled at v − η, measured by a step of learning rate 0 with replay on and with it off. In one
process, no Redis. The loop's pieces (setup, start, versions, greedy eval) are bench/learning/staleness_cell.py's."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.learning.staleness_cell import Setup, behaviour_version, greedy_eval, start_cell
from services.rollout.engine import SamplingParams
from services.rollout.engine.torch_engine import TorchEngine
from services.trainer.batch import build_batch
from services.trainer.step import policy_logprobs, train_on_batch
from shared.protocol.episode.fold import Episode
from shared.runtime.moe.routers import Routers

PROBE_ETAS = (0, 1, 2, 4, 8)


@dataclass
class Replay:
    """What one run trains with: routing replay on or off, and the rollout engine's dtype (the trainer is fp32)."""

    replay: bool = True
    engine_dtype: str = "float32"

    @property
    def name(self) -> str:
        return f"{'replay' if self.replay else 'no-replay'}{'' if self.engine_dtype == 'float32' else '-bf16'}"


def make_moe_model(out_dir: Path, seed: int) -> str:
    """The default MoE model of ``streamrl run --model-moe qwen3``: its shape, family, task and warm start."""
    from services.ops.launch.default_model import MOE_WARM_STEPS, make_default_model

    return make_default_model(out_dir, warm_steps=MOE_WARM_STEPS["qwen3"], seed=seed, moe="qwen3")


def task_pool(seed: int = 12345) -> list[dict]:
    """The default run's task: the built-in arithmetic (100 distinct problems; no held-out split is possible)."""
    from services.driver.tasks import builtin

    return builtin("arithmetic", 4096, seed=seed)


def make_engine(model_dir: str, dtype: str, max_batch_size: int) -> TorchEngine:
    """The torch engine recording routes; ``dtype`` bfloat16 casts its model after loading (the engine has no
    setting for it: a bench-only way; its weight loads cast to the model's dtype)."""
    engine = TorchEngine(model_dir, max_batch_size=max_batch_size, routing_replay=True)
    if dtype != "float32":
        engine.runner.model.to(getattr(torch, dtype))
    return engine


def load_version(engine: TorchEngine, state: dict, version: int) -> None:
    """Put version ``version``'s weights (a state dict in memory) into the engine, as ``load_weights`` does a file."""
    engine.runner.load_state_dict(state)
    engine.version = version


def sample_engine(engine: TorchEngine, tok, rows: list[dict], n: int, setup: Setup, seed: int) -> list[list[Episode]]:
    """One group of ``n`` episodes per row, sampled by ``engine`` at its version: tokens, behaviour log-probs and
    routes as the engine reports them, rewards by the default reward function."""
    from services.rollout.jobs.rewards import arithmetic

    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    out: dict[str, tuple[list, list, list]] = {}
    for g, prompt in enumerate(prompts):
        for i in range(n):
            rid = f"{g}-{i}"
            params = SamplingParams(
                temperature=setup.temperature,
                max_tokens=setup.max_tokens,
                stop_token_ids=(tok.eos_token_id,),
                seed=seed * 1_000_003 + g * n + i,
            )
            engine.add_request(rid, prompt, params, setup.max_tokens)
            out[rid] = ([], [], [])
    while engine.has_unfinished():
        for c in engine.step():
            toks, lps, routes = out[c.request_id]
            toks += c.token_ids
            lps += c.logprobs
            routes += list(c.routes) if c.routes is not None else [None] * len(c.token_ids)
    groups = []
    for g, (row, prompt) in enumerate(zip(rows, prompts)):
        group = []
        for i in range(n):
            toks, lps, routes = out[f"{g}-{i}"]
            stopped = bool(toks) and toks[-1] == tok.eos_token_id
            group.append(
                Episode(
                    f"e{g}-{i}",
                    f"g{g}",
                    i,
                    prompt,
                    {"temperature": setup.temperature},
                    row,
                    tokens=toks,
                    logprobs=lps,
                    versions=[engine.version] * len(toks),
                    mask=[1] * len(toks),
                    routes=routes if engine.route_shape is not None else [],
                    status="finished",
                    finish_reason="stop" if stopped else "length",
                    reward=arithmetic(tok.decode(toks, skip_special_tokens=True), row)[0],
                )
            )
        groups.append(group)
    return groups


def only(by_staleness: dict) -> float:
    """The one value of a batch sampled at one version (a ``*_by_staleness`` stat)."""
    (value,) = by_staleness.values()
    return value


def set_replay(model, routers: Routers, on: bool) -> None:
    """Routing replay on (the trainer's forwards route the batch's logged routes) or off (the router chooses)."""
    # a forced route stays set until changed: clear it, or a forward with replay off would still be forced
    routers.force(None)
    if on:
        model.route_replay = routers
    elif hasattr(model, "route_replay"):
        del model.route_replay


def measure(model, routers: Routers, groups, pad_id: int, version: int, sc, replay: bool) -> dict:
    """The step's drift figures on ``groups`` at trainer version ``version``, replay on or off, without changing
    the model (a step of learning rate 0), and the largest |log ratio| trainer vs behaviour over the batch."""
    set_replay(model, routers, replay)
    batch = build_batch(groups, pad_id, trainer_version=version, route_shape=routers.shape if replay else None)
    stats = train_on_batch(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, sc)
    with torch.no_grad():
        logp, _ = policy_logprobs(model, batch, "cpu")
    mask = batch.loss_mask > 0
    return {
        "route_mismatch": stats.get("route_mismatch"),
        "mismatch_kl": only(stats["mismatch_kl_by_staleness"]),
        "is_weight_mean": stats["is_weight_mean"],
        "is_weight_max": stats["is_weight_max"],
        "max_abs_log_ratio": float((logp[mask] - batch.behav_logp[mask]).abs().max()),
        "tokens": int(mask.sum()),
    }


def run_cell(
    model_dir: str,
    eta: int,
    mode: Replay,
    seed: int,
    setup: Setup,
    pool: list[dict],
    probe_every: int = 0,
    probe_groups: int = 4,
    eval_rows: list[dict] | None = None,
    on_step=None,
    probe_etas: tuple[int, ...] = PROBE_ETAS,
) -> dict:
    """Train ``setup.steps`` versions at staleness exactly η with ``mode``; return the reward curve, the per-step
    route mismatch (replay on) and mismatch KL, the final greedy accuracy on ``eval_rows``, and every
    ``probe_every`` versions (from version max(``probe_etas``)) the probes of each of those η, replay on and off.
    ``on_step(version, groups, stats)``: called after each step with the episodes it trained on."""
    tok, model, _, opt, sc, _, rows, snapshots = start_cell(model_dir, "default", seed, setup, pool)
    routers = Routers.of(model)
    routers.check_replay(model, model.config.get_text_config().vocab_size)
    engine = make_engine(model_dir, mode.engine_dtype, setup.batch_groups * setup.group_size)
    keep = max(probe_etas + (eta,))
    probe_rows = iter(rows[::-1])
    curve, behaviour, route_mismatch, kl, probes = [], [], [], [], []
    for v in range(setup.steps):
        if probe_every and v >= keep and (v - keep) % probe_every == 0:
            probe = {"version": v}
            chunk = [next(probe_rows) for _ in range(probe_groups)]
            for e in probe_etas:
                load_version(engine, snapshots[v - e], v - e)
                groups = sample_engine(engine, tok, chunk, setup.group_size, setup, seed + 7919 * (v + 1) + e)
                probe[str(e)] = {
                    "replay": measure(model, routers, groups, tok.pad_token_id, v, sc, True),
                    "no-replay": measure(model, routers, groups, tok.pad_token_id, v, sc, False),
                }
            probes.append(probe)
        bv = behaviour_version(v, eta)
        load_version(engine, snapshots[bv], bv)
        chunk = rows[v * setup.batch_groups : (v + 1) * setup.batch_groups]
        groups = sample_engine(engine, tok, chunk, setup.group_size, setup, seed * 100_003 + v)
        set_replay(model, routers, mode.replay)
        batch = build_batch(
            groups, tok.pad_token_id, trainer_version=v, route_shape=routers.shape if mode.replay else None
        )
        stats = train_on_batch(model, opt, batch, sc)
        snapshots[v + 1] = copy.deepcopy(model.state_dict())
        snapshots.pop(v + 1 - keep - 1, None)
        curve.append(float(batch.rewards.mean()))
        behaviour.append(int(batch.versions[batch.loss_mask > 0].unique().item()))
        route_mismatch.append(stats.get("route_mismatch"))
        kl.append(only(stats["mismatch_kl_by_staleness"]))
        if on_step:
            on_step(v, groups, stats)
    routers.force(None)
    return {
        "eta": eta,
        "mode": mode.name,
        "seed": seed,
        "curve": [round(r, 4) for r in curve],
        "behaviour_versions": behaviour,
        "route_mismatch": route_mismatch,
        "mismatch_kl": kl,
        "eval": greedy_eval(model.eval(), tok, eval_rows, setup.eval_tokens) if eval_rows else None,
        "probes": probes,
    }
