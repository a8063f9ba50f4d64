"""One training step on a batch: the objective of docs/training.md, as the trainer runs it.

    model in eval mode (no dropout; gradients still flow)
    split the batch into ``ppo_minibatches`` minibatches (contiguous rows, about equal tokens), each
      into micro-batches of at most ``micro_batch_tokens`` padded tokens (at least one row)
    proximal log-probs: one no_grad forward over every micro-batch, before any update
    for each minibatch: zero grads; for each micro-batch: forward, loss with the minibatch's
      denominator, backward (the gradients accumulate to the minibatch's exactly); clip the grad
      norm; a non-finite loss or grad norm skips the optimizer step (counted), else step

Under torchrun (services/trainer/distributed.py) every rank holds the whole batch and plans the same
minibatches; each trains its share of each minibatch's rows (every ``size``-th row), with the minibatch's
denominator over all its rows, so the gradients summed over ranks are the single process's. Every rank runs
as many forwards as the busiest one (FSDP2 gathers weights in each; an idle rank's forward has weight 0), and
the losses, counts and stats are summed over ranks.

Every log-prob is ``shared.protocol.episode.logprobs.token_logprobs`` under the episode's own sampling
params (temperature, top-k, top-p), the definition the rollout engines record behaviour log-probs with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.trainer.batch import Batch
from services.trainer.distributed import LOCAL, Shard, as_float
from services.trainer.objective.corrections import mismatch, route_mismatch
from services.trainer.objective.loss import aggregate_denominator, decoupled_ppo_loss, ppo_clip_loss
from shared.protocol.episode.logprobs import token_logprobs

WEIGHTED_STATS = (
    "clip_fraction",
    "approx_kl",
    "is_weight_mean",
    "is_truncated_fraction",
    "is_masked_fraction",
    "icepop_masked_fraction",
    "m2po_masked_fraction",
)


@dataclass
class StepConfig:
    # decoupled | ppo
    loss: str = "decoupled"
    agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    is_cap: float | None = 5.0
    is_mode: str = "mask"
    ppo_minibatches: int = 2
    # 0: no limit
    micro_batch_tokens: int = 0
    max_grad_norm: float = 1.0
    is_level: str = "token"
    icepop_beta: float = 0.0
    m2po_tau: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> "StepConfig":
        return cls(
            cfg.loss,
            cfg.agg,
            cfg.clip_low,
            cfg.clip_high,
            cfg.clip_ratio_c or None,
            cfg.is_cap or None,
            cfg.is_mode,
            cfg.ppo_minibatches,
            cfg.micro_batch_tokens,
            cfg.max_grad_norm,
            cfg.is_level,
            cfg.icepop_beta,
            cfg.m2po_tau,
        )


def policy_logprobs(model, mb: Batch, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [b, L-1] of the targets under each row's sampling transform, logits [b, L-1, V]). A model with
    routing replay (``model.route_replay``, shared/runtime/moe/routers.py) routes the batch's logged routes."""
    logp, logits, _ = forward(model, mb, device)
    return logp, logits


def forward(model, mb: Batch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``policy_logprobs`` and the model's own router loss: a mixture of experts whose config asks for it
    (``output_router_logits``) returns its load-balancing loss, weighted by its ``router_aux_loss_coef``; else None."""
    routers = getattr(model, "route_replay", None)
    if routers is not None:
        # the last input position predicts no target: its router chooses
        routers.force(None if mb.routes is None else torch.nn.functional.pad(mb.routes, (0, 0, 0, 0, 0, 1), value=-1))
    out = model(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device))
    logits = out.logits[:, :-1]
    logp = token_logprobs(
        logits, mb.targets.to(device), mb.temperature.to(device), mb.top_k.to(device), mb.top_p.to(device)
    )
    aux = getattr(out, "aux_loss", None)
    if aux is not None:
        aux = getattr(model.config, "router_aux_loss_coef", 0.0) * aux
    return logp, logits, aux


def minibatches(batch: Batch, n: int) -> list[list[int]]:
    """Contiguous row ranges with about equal trained tokens each (empty ones left out)."""
    tokens = batch.loss_mask.sum(dim=1).tolist()
    total, out, cur, acc = sum(tokens), [], [], 0.0
    for i, t in enumerate(tokens):
        cur.append(i)
        acc += t
        if len(out) < n - 1 and acc >= total * (len(out) + 1) / n:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return [rows for rows in out if rows]


def micro_batches(batch: Batch, rows: list[int], budget: int) -> list[list[int]]:
    """Rows packed in order while (rows × longest row) <= ``budget`` padded tokens; one row at least."""
    lengths = batch.lengths.tolist()
    out, cur, longest = [], [], 0
    for i in rows:
        wider = max(longest, lengths[i])
        if cur and budget > 0 and (len(cur) + 1) * wider > budget:
            out.append(cur)
            cur, wider = [], lengths[i]
        cur.append(i)
        longest = wider
    if cur:
        out.append(cur)
    return out


def entropy(logits: torch.Tensor, temperature: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """(sum over unmasked tokens of the entropy of softmax(logits / T), their count)."""
    keep = mask.bool()
    t = torch.where(temperature > 0, temperature, 1.0)[:, None, None]
    scaled = torch.where(keep.unsqueeze(-1), logits.float() / t, 0.0)
    ent = torch.logsumexp(scaled, -1) - (scaled.softmax(-1) * scaled).sum(-1)
    return float(torch.where(keep, ent, 0.0).sum()), int(keep.sum())


def no_dropout(model) -> None:
    """Forward without dropout, gradients still flowing: eval mode, or, with gradient checkpointing (which
    transformers runs only in training mode), training mode with every dropout module switched off."""
    # transformers >= 5.23
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    # earlier releases' name (deprecated in 5.23)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        model.train()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.eval()
    else:
        model.eval()


def plan(batch: Batch, sc: StepConfig, shard: Shard = LOCAL) -> list[tuple[list[int], list[list[int]]]]:
    """(minibatch rows, this rank's micro-batches) per minibatch; every rank gets as many micro-batches (an
    empty one: a forward that trains nothing). One process: every row, as ``micro_batches`` packs them."""
    out = []
    for rows in minibatches(batch, sc.ppo_minibatches):
        per_rank = [micro_batches(batch, rows[r :: shard.size], sc.micro_batch_tokens) for r in range(shard.size)]
        mine = per_rank[shard.rank]
        out.append((rows, mine + [[]] * (max(map(len, per_rank)) - len(mine))))
    return out


def train_on_batch(model, opt, batch: Batch, sc: StepConfig, device="cpu", kl=None, shard: Shard = LOCAL) -> dict:
    """Run the step; return its stats (python floats; counts as ints; ``mismatch_kl`` and its split by staleness
    from the proximal forward: under torchrun over this rank's rows). ``kl(mb, logp, device)``, when given, is
    a token-mean penalty over a micro-batch (``kl_coef`` × KL to the reference), added with the micro-batch's
    share of its minibatch's tokens. ``shard``: this rank's place under torchrun (the stats are every rank's)."""
    no_dropout(model)
    steps = plan(batch, sc, shard)
    prox = torch.zeros_like(batch.behav_logp)
    # routing replay: targets whose router would have chosen other experts than the logged ones
    moved = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
    routers = getattr(model, "route_replay", None)
    ent_sum = ent_n = 0
    with torch.no_grad():
        for rows, micros in steps:
            for micro in micros:
                mb = batch.rows(micro or rows[:1])
                logp, logits = policy_logprobs(model, mb, device)
                if micro:
                    prox[micro, : logp.shape[1]] = logp.float().cpu()
                    if routers is not None and routers.moved is not None:
                        moved[micro, : logp.shape[1]] = routers.moved.view(len(micro), -1)[:, :-1]
                    s, n = entropy(logits, mb.temperature.to(device), mb.loss_mask.to(device))
                    ent_sum, ent_n = ent_sum + s, ent_n + n
    # rows whose prox this rank has
    own = sorted(r for _, micros in steps for micro in micros for r in micro)
    drift = mismatch(prox[own], batch.behav_logp[own], batch.loss_mask[own].bool(), batch.versions[own], batch.version)
    if batch.routes is not None:
        routed = batch.loss_mask[own].bool() & (batch.routes[own][..., 0, 0] >= 0)
        drift |= route_mismatch(moved[own], routed, batch.versions[own], batch.version)
    sums = dict.fromkeys(WEIGHTED_STATS, 0.0)
    weight_max, losses, norms, skipped, counted, kl_sum = 0.0, [], [], 0, 0, 0.0
    aux_sum, has_aux = 0.0, False
    for rows, micros in steps:
        denom = aggregate_denominator(batch.loss_mask[rows], sc.agg)
        opt.zero_grad(set_to_none=True)
        loss_total = 0.0
        for micro in micros:
            # this rank has no row left in the minibatch: a forward and backward of weight 0
            if not micro:
                (policy_logprobs(model, batch.rows(rows[:1]), device)[1].float().sum() * 0.0).backward()
                continue
            mb = batch.rows(micro)
            loss, stats = _micro_loss(
                model,
                mb,
                prox[micro, : mb.targets.shape[1]],
                sc,
                denom,
                device,
                kl,
                mb.num_tokens / max(int(batch.loss_mask[rows].sum()), 1),
            )
            # the ranks' gradients are averaged: x size makes their sum
            (loss * shard.size).backward()
            loss_total += float(loss.detach())
            n = mb.num_tokens
            counted += n
            for k in WEIGHTED_STATS:
                sums[k] += stats.get(k, 0.0) * n
            weight_max = max(weight_max, stats.get("is_weight_max", 0.0))
            kl_sum += stats.get("kl", 0.0) * n
            aux_sum, has_aux = aux_sum + stats.get("router_aux_loss", 0.0) * n, has_aux or "router_aux_loss" in stats
        loss_total = shard.sum([loss_total])[0]
        grad_norm = as_float(torch.nn.utils.clip_grad_norm_(model.parameters(), sc.max_grad_norm))
        if not (math.isfinite(loss_total) and math.isfinite(grad_norm)):
            opt.zero_grad(set_to_none=True)
            skipped += 1
        else:
            opt.step()
        losses.append(loss_total)
        norms.append(grad_norm)
    counted, kl_sum, aux_sum, ent_sum, ent_n, *weighted = shard.sum(
        [counted, kl_sum, aux_sum, ent_sum, ent_n, *sums.values()]
    )
    weight_max = shard.max(weight_max)
    out = {k: v / max(counted, 1) for k, v in zip(sums, weighted)}
    return (
        out
        | {
            "is_weight_max": weight_max,
            "loss": sum(losses) / max(len(losses), 1),
            "grad_norm": _mean([g for g in norms if math.isfinite(g)]),
            "entropy": ent_sum / max(ent_n, 1),
            "ppo_steps": len(steps) - skipped,
            "nonfinite_skipped": skipped,
            "micro_batches": int(shard.sum([sum(bool(m) for _, micros in steps for m in micros)])[0]),
        }
        | drift
        | ({"kl": kl_sum / max(counted, 1)} if kl else {})
        | ({"router_aux_loss": aux_sum / max(counted, 1)} if has_aux else {})
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _micro_loss(
    model, mb: Batch, prox: torch.Tensor, sc: StepConfig, denom: float, device, kl=None, share: float = 1.0
):
    logp, _, aux = forward(model, mb, device)
    mask, behav, adv = mb.loss_mask.to(device), mb.behav_logp.to(device), mb.advantages.to(device)
    if sc.loss == "decoupled":
        loss, stats = decoupled_ppo_loss(
            logp,
            prox.to(device),
            behav,
            adv,
            mask,
            sc.clip_low,
            sc.clip_high,
            sc.is_cap,
            sc.agg,
            sc.is_mode,
            sc.clip_ratio_c,
            denom,
            sc.is_level,
            sc.icepop_beta,
            sc.m2po_tau,
        )
    else:
        loss, stats = ppo_clip_loss(logp, behav, adv, mask, sc.clip_low, sc.clip_high, sc.agg, sc.clip_ratio_c, denom)
    if kl is not None:
        term = kl(mb, logp, device)
        loss, stats = loss + share * term, {**stats, "kl": float(term.detach())}
    if aux is not None:
        loss, stats = loss + share * aux, {**stats, "router_aux_loss": float(aux.detach())}
    return loss, stats
