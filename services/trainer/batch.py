"""Episodes -> training tensors. Pure: no Redis, no model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.loss import grpo_advantages
from shared.protocol.fold import Episode


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] input_ids shifted: logits[:, t] predicts targets[:, t]
    loss_mask: torch.Tensor  # [B, L-1] 1 where the target is a policy-generated response token
    behav_logp: torch.Tensor  # [B, L-1] behaviour log-probs at loss positions, 0 elsewhere
    versions: torch.Tensor  # [B, L-1] producing policy version at loss positions, -1 elsewhere
    advantages: torch.Tensor  # [B] group-normalised
    temperature: torch.Tensor  # [B] sampling temperature of each episode (1 for greedy)
    rewards: torch.Tensor  # [B]
    episode_ids: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def build_batch(groups: list[list[Episode]], pad_id: int) -> Batch:
    """One row per finished episode; advantages normalised within each group."""
    episodes = [ep for group in groups for ep in group]
    if not episodes:
        raise ValueError("build_batch: no episodes")
    advantages = torch.cat([grpo_advantages(torch.tensor([[ep.reward for ep in g]], dtype=torch.float32))[0]
                            for g in groups])
    # an agent episode whose agent rewrote its history trains each forked chain as one more row, same advantage
    advantages = torch.cat([advantages[i].repeat(len(ep.rows)) for i, ep in enumerate(episodes)])
    episodes = [row for ep in episodes for row in ep.rows]
    width = max(len(ep.prompt_ids) + len(ep.tokens) for ep in episodes)
    n = len(episodes)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))
    behav = torch.zeros((n, width - 1))
    versions = torch.full((n, width - 1), -1, dtype=torch.long)
    for i, ep in enumerate(episodes):
        ids = ep.prompt_ids + ep.tokens
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
        start = len(ep.prompt_ids) - 1  # target index of the first response token
        end = start + len(ep.tokens)
        loss_mask[i, start:end] = torch.tensor(ep.mask, dtype=torch.float32)
        behav[i, start:end] = torch.tensor(ep.logprobs)
        versions[i, start:end] = torch.tensor(ep.versions)
    temps = torch.tensor([float(ep.sampling.get("temperature", 1.0)) or 1.0 for ep in episodes])
    return Batch(input_ids, attention, input_ids[:, 1:].clone(), loss_mask, behav, versions, advantages, temps,
                 torch.tensor([ep.reward for ep in episodes]), [ep.episode_id for ep in episodes])
