"""Episodes -> training tensors. Pure: no Redis, no model.

What trains (docs/training.md, "What is trained"):

- an episode the policy ended badly (``finished`` with reason 'length', 'context' or 'tool_limit', or
  with a malformed tool call in it) trains with reward 0, whatever the reward function said: the
  policy caused it, so it gets the negative signal. Counted as ``policy_failures``.
- ``failed`` episodes (engine or reward function errors: not the policy's doing) are left out before
  the group advantage; the trainer counts them.
- a greedy episode (temperature 0) keeps its place in the group advantage but its tokens are masked
  out of the loss (a deterministic behaviour has no score function). Counted as ``greedy_tokens``.
- a token more than ``hard_max_staleness`` versions behind the trainer is masked out of the loss
  (0: never); counted as ``stale_tokens_masked``. Younger stale tokens train, corrected by the
  importance weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.trainer.objective.loss import grpo_advantages
from shared.protocol.episode.fold import Episode
from shared.protocol.episode.routes import RouteShape

POLICY_FAILURE_REASONS = ("length", "context", "tool_limit")
MALFORMED_CALL = "malformed tool call"


@dataclass
class Batch:
    # [B, L] prompt + response, right-padded
    input_ids: torch.Tensor
    # [B, L]
    attention_mask: torch.Tensor
    # [B, L-1] input_ids shifted: logits[:, t] predicts targets[:, t]
    targets: torch.Tensor
    # [B, L-1] 1 where the target is a trained policy-generated response token
    loss_mask: torch.Tensor
    # [B, L-1] behaviour log-probs at loss positions, 0 elsewhere
    behav_logp: torch.Tensor
    # [B, L-1] producing policy version at loss positions, -1 elsewhere
    versions: torch.Tensor
    # [B] group-normalised
    advantages: torch.Tensor
    # [B] sampling temperature of each episode (0: greedy)
    temperature: torch.Tensor
    # [B] (0: off)
    top_k: torch.Tensor
    # [B] (1: off)
    top_p: torch.Tensor
    # [B] as trained (policy failures 0)
    rewards: torch.Tensor
    episode_ids: list[str]
    # episodes trained with reward 0 because the policy ended them badly
    policy_failures: int = 0
    # policy tokens of greedy episodes, not trained
    greedy_tokens: int = 0
    # policy tokens past hard_max_staleness, not trained
    stale_tokens_masked: int = 0
    # the trainer's version the batch was built for (staleness = version - token version)
    version: int = 0
    # [B, L-1, layers, top_k] a mixture-of-experts policy's logged routes at each target's input position, -1
    # where the router chooses (prompt, tool output, a token logged without routes); None: no routing replay
    routes: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def lengths(self) -> torch.Tensor:
        """[B] real (unpadded) length of each row."""
        return self.attention_mask.sum(dim=1)

    def rows(self, index: list[int] | torch.Tensor) -> "Batch":
        """The sub-batch of these rows, right padding trimmed to its longest row (same values elsewhere)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        width = max(int(self.lengths[idx].max()), 2) if len(idx) else 2
        return Batch(
            self.input_ids[idx, :width],
            self.attention_mask[idx, :width],
            self.targets[idx, : width - 1],
            self.loss_mask[idx, : width - 1],
            self.behav_logp[idx, : width - 1],
            self.versions[idx, : width - 1],
            self.advantages[idx],
            self.temperature[idx],
            self.top_k[idx],
            self.top_p[idx],
            self.rewards[idx],
            [self.episode_ids[i] for i in idx.tolist()],
            routes=None if self.routes is None else self.routes[idx, : width - 1],
        )


def trained_reward(ep: Episode) -> tuple[float, bool]:
    """(reward the trainer uses, whether the policy caused a failure): a failure trains with reward 0."""
    malformed = any(not r["ok"] and str(r["output"]).startswith(MALFORMED_CALL) for r in ep.tool_results)
    if ep.finish_reason in POLICY_FAILURE_REASONS or malformed:
        return 0.0, True
    return float(ep.reward), False


def build_batch(
    groups: list[list[Episode]],
    pad_id: int,
    trainer_version: int = 0,
    hard_max_staleness: int = 0,
    route_shape: RouteShape | None = None,
) -> Batch:
    """One row per finished episode; advantages normalised within each group, on the trained rewards.
    ``route_shape``: replay the routes of a mixture-of-experts policy of that shape (None: no replay)."""
    episodes = [ep for group in groups for ep in group]
    if not episodes:
        raise ValueError("build_batch: no episodes")
    judged = [trained_reward(ep) for ep in episodes]
    rewards = torch.tensor([r for r, _ in judged], dtype=torch.float32)
    sizes = [len(g) for g in groups]
    advantages = torch.cat([grpo_advantages(chunk[None])[0] for chunk in rewards.split(sizes)])
    # an agent episode whose agent rewrote its history trains each forked chain as one more row, same advantage
    rows_per_episode = torch.tensor([len(ep.rows) for ep in episodes])
    advantages, rewards = advantages.repeat_interleave(rows_per_episode), rewards.repeat_interleave(rows_per_episode)
    episodes = [row for ep in episodes for row in ep.rows]
    width = max(len(ep.prompt_ids) + len(ep.tokens) for ep in episodes)
    n = len(episodes)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))
    behav = torch.zeros((n, width - 1))
    versions = torch.full((n, width - 1), -1, dtype=torch.long)
    routes = None
    if route_shape is not None and any(ep.routes for ep in episodes):
        routes = torch.full((n, width - 1, route_shape.layers, route_shape.top_k), -1, dtype=torch.int16)
    greedy_tokens = stale = 0
    for i, ep in enumerate(episodes):
        ids = ep.prompt_ids + ep.tokens
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        # target index of the first response token
        start = len(ep.prompt_ids) - 1
        end = start + len(ep.tokens)
        mask = torch.tensor(ep.mask, dtype=torch.float32)
        vers = torch.tensor(ep.versions, dtype=torch.long)
        if float(ep.sampling.get("temperature", 1.0)) <= 0:
            greedy_tokens += int(mask.sum())
            mask = torch.zeros_like(mask)
        elif hard_max_staleness > 0:
            too_old = (mask > 0) & (vers >= 0) & (trainer_version - vers > hard_max_staleness)
            stale += int(too_old.sum())
            mask = torch.where(too_old, 0.0, mask)
        loss_mask[i, start:end] = mask
        behav[i, start:end] = torch.tensor(ep.logprobs)
        versions[i, start:end] = vers
        if routes is not None and ep.routes:
            held = [j for j, r in enumerate(ep.routes) if r is not None]
            if held:
                rows = torch.from_numpy(np.stack([ep.routes[j] for j in held]).astype(np.int16))
                routes[i, torch.tensor(held) + start] = rows
    sampling = [ep.sampling for ep in episodes]
    return Batch(
        input_ids,
        attention,
        input_ids[:, 1:].clone(),
        loss_mask,
        behav,
        versions,
        advantages,
        torch.tensor([float(s.get("temperature", 1.0)) for s in sampling]),
        torch.tensor([int(s.get("top_k", 0) or 0) for s in sampling]),
        torch.tensor([float(s.get("top_p", 1.0) or 1.0) for s in sampling]),
        rewards,
        [ep.episode_id for ep in episodes],
        sum(f for _, f in judged),
        greedy_tokens,
        stale,
        trainer_version,
        routes,
    )
