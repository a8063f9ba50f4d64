"""KL to a frozen reference model, per token, as a loss term.

With ``r = log pi_ref(a) - log pi(a)`` at a sampled token (the tokens come from the policy):

- ``k1 = -r``: the log ratio; unbiased for KL(pi || pi_ref), but any single token can be negative.
- ``k3 = exp(r) - 1 - r``: Schulman's estimator, unbiased and never negative (lower variance).

The term added to the loss is ``kl_coef`` times the token mean over the loss mask.

Both log-probs are ``shared.protocol.episode.logprobs.token_logprobs`` under each row's own sampling transform
(temperature, top-k, top-p), the one definition the sampler and the policy loss use: the reference is
compared with the policy on the same footing. Positions outside the mask (greedy rows, prompts, tool
results) may be -inf there; they are selected out, never multiplied by 0 (inf x 0 is NaN)."""

from __future__ import annotations

import torch


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    r = ref_logp - logp
    if estimator == "k1":
        return -r
    if estimator == "k3":
        return torch.exp(r) - 1 - r
    raise ValueError(f"config key 'kl_estimator': expected 'k1' or 'k3', got {estimator!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    keep = mask > 0
    return torch.where(keep, x, torch.zeros_like(x)).sum() / keep.sum().clamp(min=1).to(x.dtype)


def kl_term(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """Token-mean KL over ``mask`` (differentiable through ``logp``; ``ref_logp`` carries no gradient)."""
    return masked_mean(kl_per_token(logp, ref_logp.detach(), estimator), mask)
