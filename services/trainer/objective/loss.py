"""Policy-gradient losses for GRPO/PPO with off-policy correction. Pure torch, no I/O.

Conventions: ``logp``, ``old_logp``, ``prox_logp``, ``behav_logp`` and ``mask`` are [B, T];
``advantages`` is [B] (one per sequence, broadcast over tokens) or [B, T]. ``mask`` is 1 on
policy-generated tokens and 0 on prompt, tool-output and padding tokens. Masked positions are
replaced with ``torch.where`` *before* any arithmetic, so garbage there (NaN, inf) never reaches the
loss value nor the gradient, and the gradient at a masked position is exactly 0.

Aggregations of a per-token objective o (loss = -aggregate(o)), with m the mask:

- ``token-mean``: sum(o·m) / sum(m) over the whole batch;
- ``seq-mean-token-mean``: per sequence sum_t(o·m) / sum_t(m), then mean over sequences with sum_t(m) ≥ 1;
- ``seq-mean-token-sum``: per sequence sum_t(o·m), then mean over sequences with sum_t(m) ≥ 1.

An all-masked batch gives a loss of 0 (still attached to the graph).

Stats (python floats, token-level over unmasked tokens): ``clip_fraction``; ``approx_kl``, the k3
estimator of KL(behaviour ‖ current) from tokens sampled by the behaviour policy,
mean(r − 1 − log r) with log r = logp − behav_logp (unbiased, ≥ 0 per token); and, for the
decoupled loss only, ``is_weight_mean``, ``is_weight_max`` (after truncation) and
``is_truncated_fraction``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from services.trainer.objective.corrections import Correction, behaviour_weights
from shared.protocol.episode.logprobs import token_logprobs  # noqa: F401  (the one log-prob definition, re-exported)

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def grpo_advantages(
    rewards: Tensor | Sequence[Sequence[float]], eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """Group-normalised advantages A = (r − mean_g) / (std_g + eps), std the population std.

    ``normalize_std=False`` gives A = r − mean_g. A group whose rewards are all equal gets exact zeros.
    A [G, n] tensor gives [G, n]; a list of groups (sizes may differ) gives their advantages
    concatenated in order, 1-D.
    """
    if isinstance(rewards, Tensor):
        if rewards.dim() != 2:
            raise ValueError(f"grpo_advantages: rewards must be [G, n], got shape {tuple(rewards.shape)}")
        r = rewards.float() if not rewards.is_floating_point() else rewards
        if not torch.isfinite(r).all():
            raise ValueError("grpo_advantages: rewards must be finite")
        centred = r - r.mean(dim=1, keepdim=True)
        adv = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps) if normalize_std else centred
        constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
        return torch.where(constant, torch.zeros_like(adv), adv)
    groups = [torch.as_tensor(g, dtype=torch.float32).reshape(1, -1) for g in rewards]
    if any(g.numel() == 0 for g in groups):
        raise ValueError("grpo_advantages: every group needs at least one reward")
    return torch.cat([grpo_advantages(g, eps, normalize_std)[0] for g in groups]) if groups else torch.zeros(0)


def entropy_from_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """Masked token-mean entropy: H_t = logsumexp(l_t) − Σ_v softmax(l_t)_v · l_t,v; 0 if nothing is unmasked."""
    keep = mask.bool()
    logits = torch.where(keep.unsqueeze(-1), logits.float(), 0.0)
    probs = torch.softmax(logits, dim=-1)
    ent = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
    return torch.where(keep, ent, 0.0).sum() / keep.sum().clamp(min=1)


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    clip_ratio_c: float | None = None,
    denom: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip against ``old_logp``: r = exp(logp − old_logp), o = min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A),
    and with ``clip_ratio_c`` = c (dual-clip, verl's ``clip_ratio_c``) o = max(o, c·A) where A < 0, which
    bounds the objective of a negative-advantage token whose ratio ran away; loss = −aggregate(o).
    ``denom``: the aggregate's denominator for gradient accumulation (see ``_aggregate``).
    Stats: clip_fraction (the PPO clip or the dual clip won), approx_kl (to ``old_logp``)."""
    keep, adv = _prepare(logp, advantages, mask, agg, old_logp=old_logp)
    logp, old_logp = _clean(logp, keep), _clean(old_logp, keep)
    obj, clipped = _clipped_objective(logp, old_logp, adv, clip_low, clip_high, clip_ratio_c)
    loss = -_aggregate(obj, keep, agg, denom)
    return loss, _stats(logp, old_logp, keep, clipped)


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_cap: float | None = 5.0,
    agg: str = "token-mean",
    is_mode: str = "truncate",
    clip_ratio_c: float | None = None,
    denom: float | None = None,
    is_level: str = "token",
    icepop_beta: float = 0.0,
    m2po_tau: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """AReaL's decoupled PPO: o = w · min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A) with
    r = exp(logp − prox_logp) (the trust region, around the proximal policy) and w the behaviour importance
    weight, detached, from prox_logp − behav_logp (services/trainer/objective/corrections.py: ``is_level`` token |
    sequence | geometric, capped at ``is_cap`` by ``is_mode``; IcePop's ``icepop_beta`` and M2PO's ``m2po_tau``
    masks). At token level:

    - ``is_mode="truncate"``: w = min(w̃, is_cap) (truncated IS: the token still trains, weight capped);
    - ``is_mode="mask"``: w = w̃ if w̃ ≤ is_cap else 0 (the token is dropped from the objective, as AReaL's
      ``behav_imp_weight_cap`` and prime-rl do); it still counts in the token-mean's denominator.

    ``is_cap=None``: no cap. ``clip_ratio_c``: dual-clip as in ``ppo_clip_loss`` (on r). loss = −aggregate(o).
    With prox == behav, w = 1 and the loss equals ``ppo_clip_loss(logp, prox_logp, ...)``. Stats:
    clip_fraction, approx_kl (to behaviour), is_weight_mean, is_weight_max (after the cap),
    is_truncated_fraction and is_masked_fraction (weights over is_cap, by mode; the other is 0),
    icepop_masked_fraction, m2po_masked_fraction."""
    # validates each value
    correction = Correction(is_level, is_mode, is_cap, icepop_beta, m2po_tau)
    keep, adv = _prepare(logp, advantages, mask, agg, prox_logp=prox_logp, behav_logp=behav_logp)
    logp, prox, behav = _clean(logp, keep), _clean(prox_logp, keep), _clean(behav_logp, keep)
    w, weight_stats = behaviour_weights(prox, behav, keep, correction)
    obj, clipped = _clipped_objective(logp, prox, adv, clip_low, clip_high, clip_ratio_c)
    loss = -_aggregate(w * obj, keep, agg, denom)
    return loss, _stats(logp, behav, keep, clipped & (w > 0)) | weight_stats


def _prepare(logp: Tensor, advantages: Tensor, mask: Tensor, agg: str, **others: Tensor) -> tuple[Tensor, Tensor]:
    """Validate shapes and ``agg``; return the boolean mask and [B, T] advantages (0 where masked)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; expected one of {', '.join(AGGREGATIONS)}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in {"mask": mask, **others}.items():
        if t.shape != logp.shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(logp.shape)}, got {tuple(t.shape)}")
    if advantages.shape == logp.shape[:1]:
        advantages = advantages[:, None].expand_as(logp)
    elif advantages.shape != logp.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] for logp {tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )
    keep = mask.bool()
    return keep, _clean(advantages.detach().to(logp.dtype), keep)


def _clean(x: Tensor, keep: Tensor) -> Tensor:
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _clipped_objective(
    logp: Tensor, ref_logp: Tensor, adv: Tensor, clip_low: float, clip_high: float, clip_ratio_c: float | None = None
) -> tuple[Tensor, Tensor]:
    """min(r·A, clip(r)·A) per token, r = exp(logp − ref_logp) with ref detached, then max(·, c·A) where
    A < 0 when ``clip_ratio_c`` = c is given; also where a clip won (its gradient is 0 there)."""
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c must be > 1 (or None: no dual clip), got {clip_ratio_c!r}")
    ratio = torch.exp(logp - ref_logp.detach())
    unclipped = ratio * adv
    clipped_obj = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    clipped = clipped_obj < unclipped
    obj = torch.where(clipped, clipped_obj, unclipped)
    if clip_ratio_c is not None:
        floor = clip_ratio_c * adv
        dual = (adv < 0) & (obj < floor)
        obj, clipped = torch.where(dual, floor, obj), clipped | dual
    return obj, clipped


def aggregate_denominator(mask: Tensor, agg: str) -> float:
    """The aggregate's denominator over ``mask``: unmasked tokens (token-mean) or sequences with at least one
    (seq-mean-*). Passing the whole batch's value as ``denom`` to each micro-batch's loss makes the
    micro-batch losses (and gradients) sum to the whole batch's."""
    keep = mask.bool()
    return float(keep.sum() if agg == "token-mean" else (keep.sum(dim=1) > 0).sum())


def _aggregate(obj: Tensor, keep: Tensor, agg: str, denom: float | None = None) -> Tensor:
    obj = torch.where(keep, obj, 0.0)
    if agg == "token-mean":
        total = obj.sum()
    else:
        total = obj.sum(dim=1)
        if agg == "seq-mean-token-mean":
            total = total / keep.sum(dim=1).clamp(min=1)
        total = total.sum()
    if denom is None:
        denom = aggregate_denominator(keep, agg)
    return total / max(denom, 1.0)


@torch.no_grad()
def _stats(logp: Tensor, behav: Tensor, keep: Tensor, clipped: Tensor) -> dict[str, float]:
    n = max(int(keep.sum()), 1)
    log_r = logp - behav
    k3 = torch.where(keep, torch.exp(log_r) - 1.0 - log_r, 0.0)
    return {"clip_fraction": int((clipped & keep).sum()) / n, "approx_kl": float(k3.sum()) / n}
