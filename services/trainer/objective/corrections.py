"""Off-policy corrections: the behaviour importance weight of each trained token, and the masks that drop tokens
too far off-policy. Pure torch, no I/O; the loss (loss.py) multiplies its clipped objective by the weight.

With d_t = prox_t − behav_t (the trainer's log-prob of a sampled token before this step's updates, less the
sampler's) over the kept tokens of a sequence, and C = ``is_cap``:

- ``is_level = "token"``: w̃_t = exp(d_t) (AReaL's decoupled PPO);
- ``is_level = "sequence"``: w̃_t = exp(Σ_s d_s), one weight for the whole sequence;
- ``is_level = "geometric"``: w̃_t = exp(mean_s d_s), the sequence's geometric-mean ratio.

``is_mode = "truncate"``: w = min(w̃, C); ``is_mode = "mask"``: w = w̃ where w̃ ≤ C, else 0 (at sequence and
geometric level the whole sequence leaves the objective). ``is_cap`` None: w = w̃. Then, each off at 0:

- ``icepop_beta`` = β (IcePop): tokens whose own ratio exp(d_t) is outside [1/β, β] get w = 0;
- ``m2po_tau`` = τ (M2PO, arXiv 2510.01161): the tokens with the largest d_t² get w = 0, fewest first, until
  the mean of d_t² over the tokens left is ≤ τ (the batch's second moment of the log-ratio bounded).

A dropped token still counts in the aggregate's denominator (its objective is 0, its gradient 0).

``mismatch`` measures what the corrections correct: the k3 estimate of KL(sampler ‖ trainer) over tokens made
by the trainer's own current version (the engine mismatch: the same weights, two implementations; ≈ 0 for the
torch engine), and the same per staleness η (versions behind).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
# exp(80) is finite in float32: a sequence-level weight past it is capped or masked anyway
_MAX_LOG_W = 80.0


@dataclass(frozen=True)
class Correction:
    level: str = "token"
    mode: str = "mask"
    cap: float | None = 5.0
    icepop_beta: float = 0.0
    m2po_tau: float = 0.0

    def __post_init__(self):
        if self.level not in IS_LEVELS:
            raise ValueError(f"is_level: expected one of {', '.join(IS_LEVELS)}, got {self.level!r}")
        if self.mode not in IS_MODES:
            raise ValueError(f"is_mode: expected one of {', '.join(IS_MODES)}, got {self.mode!r}")
        if self.cap is not None and not self.cap >= 1:
            raise ValueError(f"is_cap: expected a number >= 1 (or None: no cap), got {self.cap!r}")
        if self.icepop_beta and not self.icepop_beta > 1:
            raise ValueError(f"icepop_beta: expected a number > 1 (or 0: off), got {self.icepop_beta!r}")
        if self.m2po_tau < 0:
            raise ValueError(f"m2po_tau: expected a number > 0 (or 0: off), got {self.m2po_tau!r}")


@torch.no_grad()
def behaviour_weights(prox: Tensor, behav: Tensor, keep: Tensor, c: Correction) -> tuple[Tensor, dict[str, float]]:
    """(w [B, T], detached, 0 where not kept; stats). ``prox``/``behav`` must be 0 where ``keep`` is False."""
    d = torch.where(keep, prox - behav, 0.0)
    if c.level == "token":
        log_w = d
    else:
        total = d.sum(dim=1, keepdim=True)
        if c.level == "geometric":
            total = total / keep.sum(dim=1, keepdim=True).clamp(min=1)
        log_w = total.clamp(max=_MAX_LOG_W).expand_as(d)
    raw = torch.exp(log_w)
    over = keep & (raw > c.cap) if c.cap is not None else torch.zeros_like(keep)
    if c.cap is None:
        w = raw
    elif c.mode == "truncate":
        w = raw.clamp(max=c.cap)
    else:
        w = torch.where(over, 0.0, raw)
    icepop = torch.zeros_like(keep)
    if c.icepop_beta:
        # exp(d) outside [1/beta, beta]
        icepop = keep & (d.abs() > math.log(c.icepop_beta))
    m2po = second_moment_mask(d, keep, c.m2po_tau) if c.m2po_tau else torch.zeros_like(keep)
    w = torch.where(keep & ~icepop & ~m2po, w, 0.0)
    n = max(int(keep.sum()), 1)
    capped = int(over.sum()) / n
    return w, {
        "is_weight_mean": float(w.sum()) / n,
        "is_weight_max": float(w.max()) if keep.any() else 0.0,
        "is_truncated_fraction": capped if c.mode == "truncate" else 0.0,
        "is_masked_fraction": capped if c.mode == "mask" else 0.0,
        "icepop_masked_fraction": int(icepop.sum()) / n,
        "m2po_masked_fraction": int(m2po.sum()) / n,
    }


def second_moment_mask(d: Tensor, keep: Tensor, tau: float) -> Tensor:
    """The fewest kept tokens, largest d² first, whose removal leaves mean(d²) over the rest ≤ ``tau``."""
    sq = torch.where(keep, d.float() ** 2, 0.0).flatten()
    n = int(keep.sum())
    if n == 0 or float(sq.sum()) <= tau * n:
        return torch.zeros_like(keep)
    order = torch.argsort(sq, descending=True)
    ranked = sq[order]
    # after removing the first k + 1
    left_sum = ranked.sum() - torch.cumsum(ranked, 0)
    left_n = n - torch.arange(1, sq.numel() + 1, device=sq.device)
    ok = (left_n > 0) & (left_sum <= tau * left_n.clamp(min=1))
    # how many to drop
    k = int(torch.nonzero(ok)[0]) + 1 if ok.any() else n
    out = torch.zeros_like(sq, dtype=torch.bool)
    out[order[:k]] = True
    return out.view_as(keep) & keep


@torch.no_grad()
def mismatch(prox: Tensor, behav: Tensor, keep: Tensor, versions: Tensor, trainer_version: int) -> dict:
    """k3 KL(sampler ‖ trainer) = mean(exp(d) − 1 − d) over kept tokens of ``trainer_version`` (``mismatch_kl``,
    None when there are none) and per staleness η = trainer_version − version (``mismatch_kl_by_staleness``)."""
    # float64 and expm1: in float32, exp(d) − 1 − d cancels to noise for |d| ~ 1e-6
    d = (prox - behav).double()
    k3 = torch.expm1(d) - d
    stale = trainer_version - versions
    by = {}
    for eta in sorted(set(torch.where(keep, stale, -1).unique().tolist()) - {-1}):
        sel = keep & (stale == eta)
        if eta >= 0 and sel.any():
            by[str(int(eta))] = float(k3[sel].mean())
    return {"mismatch_kl": by.get("0"), "mismatch_kl_by_staleness": by}


def route_mismatch(moved: Tensor, routed: Tensor, versions: Tensor, trainer_version: int) -> dict:
    """Routing replay: the share of replayed tokens (``routed``) whose router, left to itself, would have sent them
    through other experts in at least one layer (``moved``): ``route_mismatch``, and per staleness η
    (``route_mismatch_by_staleness``). Empty when no token was replayed."""
    if not bool(routed.any()):
        return {}
    stale = trainer_version - versions
    by = {
        str(int(eta)): float(moved[routed & (stale == eta)].float().mean())
        for eta in sorted(set(stale[routed].unique().tolist()))
    }
    return {"route_mismatch": float(moved[routed].float().mean()), "route_mismatch_by_staleness": by}
