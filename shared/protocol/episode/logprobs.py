"""The one definition of a token's log-prob, shared by the rollout engines and the trainer. Pure torch.

A token sampled with (temperature T, top-k k, top-p p) was drawn from the *processed* distribution

    s = logits / T
    S = the k largest entries of s (all when k = 0 or k >= V), then the smallest prefix of S, in
        descending order of s, whose softmax mass (renormalised over S) reaches p: a token is kept while
        the mass strictly before it is < p (the first token is always kept)
    log π(x) = s_x − logsumexp_{y ∈ S} s_y   for x ∈ S,   −inf otherwise

and its behaviour log-prob (the ``tokens`` event's ``logprobs``) is log π(token) under the weights
that generated it. The trainer evaluates the same formula under its own weights: ``token_logprobs``
adds the target token to S (it was in the behaviour's S by construction, so under the generating
weights this changes nothing; under newer weights it keeps the log-prob finite when the token has
left the nucleus). Ties in s are broken by vocabulary order (stable sort), as in the sampler.

Greedy (T = 0) takes the argmax: π is one-hot, so the behaviour log-prob of a greedy token is 0. The
trainer does not train greedy episodes (a deterministic policy has no score function); see
docs/training.md.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _params(values, shape: torch.Size, device, dtype) -> Tensor:
    """A per-row parameter (float, or tensor over the leading dims, or over the first dim) -> [..., 1]."""
    t = torch.as_tensor(values, device=device, dtype=dtype)
    while t.dim() < len(shape) - 1:
        t = t.unsqueeze(-1)
    return t.expand(shape[:-1]).unsqueeze(-1)


def support_mask(scaled: Tensor, top_k, top_p) -> Tensor:
    """Boolean [..., V]: the tokens the top-k / top-p transform keeps, for temperature-scaled logits."""
    vocab = scaled.shape[-1]
    k = _params(top_k, scaled.shape, scaled.device, torch.long)
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    p = _params(top_p, scaled.shape, scaled.device, scaled.dtype)
    if bool((k >= vocab).all()) and bool((p >= 1).all()):
        return torch.ones_like(scaled, dtype=torch.bool)
    with torch.no_grad():
        sorted_vals, order = scaled.detach().sort(dim=-1, descending=True, stable=True)
        keep = torch.arange(vocab, device=scaled.device) < k
        probs = sorted_vals.masked_fill(~keep, float("-inf")).softmax(-1)
        keep &= (probs.cumsum(-1) - probs) < p
        return torch.zeros_like(keep).scatter(-1, order, keep)


def processed_logprobs(logits: Tensor, temperature, top_k=0, top_p=1.0) -> Tensor:
    """log π over the vocabulary [..., V] (−inf outside the kept set); greedy rows (T <= 0) are one-hot
    at the argmax (0 there, −inf elsewhere). ``temperature``, ``top_k``, ``top_p``: a number, or a tensor
    over the leading dims of ``logits`` (or over its first dim: one per sequence)."""
    logits = logits.float()
    temp = _params(temperature, logits.shape, logits.device, logits.dtype)
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)
    out = scaled.masked_fill(~support_mask(scaled, top_k, top_p), float("-inf")).log_softmax(-1)
    if bool(greedy.any()):
        onehot = torch.full_like(out, float("-inf")).scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
        out = torch.where(greedy, onehot, out)
    return out


def token_logprobs(logits: Tensor, targets: Tensor, temperature=1.0, top_k=0, top_p=1.0) -> Tensor:
    """log π(target) under the sampling transform, differentiable in ``logits``: [..., V], [...] -> [...].

    The kept set is the transform's set plus the target itself (see the module docstring). Greedy
    positions (T <= 0) give 0 for the argmax and −inf otherwise (constants, no gradient)."""
    logits = logits.float()
    targets = targets.long().unsqueeze(-1)
    temp = _params(temperature, logits.shape, logits.device, logits.dtype)
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)
    keep = support_mask(scaled, top_k, top_p).scatter(-1, targets, True)
    masked = scaled if bool(keep.all()) else scaled.masked_fill(~keep, float("-inf"))
    picked = scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(masked, dim=-1)
    if bool(greedy.any()):
        is_argmax = logits.argmax(-1) == targets.squeeze(-1)
        greedy_lp = torch.where(is_argmax, 0.0, float("-inf")).to(picked.dtype)
        picked = torch.where(greedy.squeeze(-1), greedy_lp, picked)
    return picked
