"""Temperature / top-k / top-p sampling whose randomness is a pure function of
(seed, position in the response), so an aborted and resumed request draws
exactly what the uninterrupted run would have drawn."""

from __future__ import annotations

import hashlib

import torch

from services.rollout.engine.base import SamplingParams
from shared.protocol.episode.logprobs import processed_logprobs


def uniform(seed: int, position: int) -> float:
    """One uniform in [0, 1) per (seed, position), identical across runs and processes."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / 2.0**53


def final_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probs [B, V] of each row's sampling distribution (temperature, then top-k, then top-p on the
    renormalised rest; cut tokens get -inf; greedy rows one-hot at the argmax): the one definition in
    ``shared.protocol.episode.logprobs``, which the trainer uses too."""
    device = logits.device
    return processed_logprobs(
        logits,
        torch.tensor([float(p.temperature) for p in params], device=device),
        torch.tensor([int(p.top_k) for p in params], device=device),
        torch.tensor([float(p.top_p) for p in params], device=device),
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> tuple[list[int], list[float]]:
    """Sample one token per row by inverse CDF (in vocabulary order, so tiny numeric
    noise only moves boundaries) with the row's (seed, position) uniform."""
    logprobs = final_logprobs(logits, params)
    cdf = logprobs.double().exp().cumsum(-1)
    u = torch.tensor(
        [uniform(p.seed, pos) for p, pos in zip(params, positions)], dtype=torch.float64, device=logits.device
    )
    last_kept = logits.shape[-1] - 1 - logprobs.isfinite().flip(-1).int().argmax(-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    # u * total may round up to total
    drawn = torch.minimum(drawn, last_kept)
    greedy = torch.tensor([p.temperature <= 0 for p in params], device=logits.device)
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()
