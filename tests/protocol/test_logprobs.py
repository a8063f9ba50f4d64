"""The one log-prob definition (shared/protocol/episode/logprobs.py): hand examples, the sampler agrees, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from services.rollout.engine.base import SamplingParams
from services.rollout.engine.sampler import sample
from shared.protocol.episode.logprobs import processed_logprobs, token_logprobs

# softmax at T = 1 is these probabilities
LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def test_top_k_and_top_p_hand_examples():
    lp = processed_logprobs(LOGITS, 1.0, top_k=2)
    assert lp.exp()[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    # top-p 0.7: mass before token 0 is 0 < 0.7, before token 1 is 0.5 < 0.7 (kept), before token 2 is 0.8 (cut)
    lp = processed_logprobs(LOGITS, 1.0, top_p=0.7)
    assert lp.exp()[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    lp = processed_logprobs(LOGITS, 1.0, top_p=0.81)
    assert lp.exp()[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    # temperature first: T = 0.5 squares the probabilities before the cut
    sq = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    lp = processed_logprobs(LOGITS, 0.5, top_k=3)
    assert lp.exp()[0].tolist() == pytest.approx((torch.cat([sq[:3], torch.zeros(1)]) / sq[:3].sum()).tolist())


def test_greedy_is_one_hot_at_the_argmax():
    assert processed_logprobs(LOGITS, 0.0).exp()[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert token_logprobs(LOGITS, torch.tensor([0]), 0.0).tolist() == [0.0]
    assert token_logprobs(LOGITS, torch.tensor([1]), 0.0).tolist() == [-math.inf]


def test_token_logprobs_keeps_the_target_when_newer_weights_cut_it():
    # token 3 is outside top-k 2; scored, it joins the kept set: log(0.05 / (0.5 + 0.3 + 0.05))
    assert token_logprobs(LOGITS, torch.tensor([3]), 1.0, 2).tolist() == pytest.approx([math.log(0.05 / 0.85)])
    assert token_logprobs(LOGITS, torch.tensor([1]), 1.0, 2).tolist() == pytest.approx([math.log(0.3 / 0.8)])


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 10, 0.9), (0.7, 0, 0.9), (1.3, 10, 1.0), (0.0, 0, 1.0)]
)
def test_the_sampler_records_what_the_trainer_computes(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 3
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=i) for i in range(64)]
    tokens, chosen = sample(logits, params, list(range(64)))
    mine = token_logprobs(
        logits, torch.tensor(tokens), torch.full((64,), temperature), torch.full((64,), top_k), torch.full((64,), top_p)
    )
    # log_softmax vs x − logsumexp
    torch.testing.assert_close(mine, torch.tensor(chosen), rtol=0, atol=2e-6)


def test_gradient_flows_through_the_kept_tokens_only():
    logits = LOGITS.clone().requires_grad_()
    token_logprobs(logits, torch.tensor([0]), 1.0, 2).sum().backward()
    assert logits.grad[0, 2:].tolist() == [0.0, 0.0]
    assert logits.grad[0, :2].tolist() == pytest.approx([1 - 0.5 / 0.8, -0.3 / 0.8])


def test_per_sequence_params_broadcast_over_positions():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1))
    targets = torch.zeros(2, 3, dtype=torch.long)
    both = token_logprobs(logits, targets, torch.tensor([1.0, 0.5]), torch.tensor([0, 3]), torch.tensor([1.0, 0.9]))
    assert torch.equal(both[0], token_logprobs(logits[0], targets[0], 1.0))
    assert torch.equal(both[1], token_logprobs(logits[1], targets[1], 0.5, 3, 0.9))
