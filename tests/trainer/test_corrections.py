"""Off-policy corrections (services/trainer/objective/corrections.py): each level and mask on hand-made log-ratios, the
mismatch measure, version spans, and the loss taking them (pure torch)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.objective.corrections import Correction, behaviour_weights, mismatch, second_moment_mask
from services.trainer.objective.loss import decoupled_ppo_loss
from shared.protocol.staleness import version_spans


def _ratios(d: list[list[float]], keep: list[list[int]] | None = None):
    d = torch.tensor(d)
    keep = torch.ones_like(d, dtype=torch.bool) if keep is None else torch.tensor(keep, dtype=torch.bool)
    # behav 0: d is the log-ratio itself
    prox = torch.where(keep, d, 0.0)
    return prox, torch.zeros_like(d), keep


def test_token_level_caps_each_token_alone():
    prox, behav, keep = _ratios([[0.0, math.log(2.0), math.log(8.0)]])
    w, stats = behaviour_weights(prox, behav, keep, Correction("token", "mask", 5.0))
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.0]]))
    assert stats["is_masked_fraction"] == pytest.approx(1 / 3) and stats["is_truncated_fraction"] == 0
    w, stats = behaviour_weights(prox, behav, keep, Correction("token", "truncate", 5.0))
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 5.0]])) and stats["is_truncated_fraction"] == pytest.approx(1 / 3)


def test_sequence_level_is_one_weight_per_sequence_and_mask_drops_the_whole_sequence():
    # row 0: log-ratios sum to log 4 (weight 4, under the cap); row 1: sum to log 8 (over it); a padded position
    prox, behav, keep = _ratios(
        [[math.log(2.0), math.log(2.0), 5.0], [math.log(2.0), math.log(4.0), 0.0]], [[1, 1, 0], [1, 1, 1]]
    )
    w, _ = behaviour_weights(prox, behav, keep, Correction("sequence", "mask", 5.0))
    assert torch.allclose(w, torch.tensor([[4.0, 4.0, 0.0], [0.0, 0.0, 0.0]]))
    w, _ = behaviour_weights(prox, behav, keep, Correction("sequence", "truncate", 5.0))
    assert torch.allclose(w, torch.tensor([[4.0, 4.0, 0.0], [5.0, 5.0, 5.0]]))


def test_geometric_level_is_the_mean_log_ratio():
    prox, behav, keep = _ratios([[math.log(2.0), math.log(8.0), 0.0]], [[1, 1, 0]])
    w, _ = behaviour_weights(prox, behav, keep, Correction("geometric", "mask", 5.0))
    # exp(mean(log 2, log 8)) = 4; the pad is not counted
    assert torch.allclose(w, torch.tensor([[4.0, 4.0, 0.0]]))


def test_a_huge_sequence_log_ratio_is_masked_not_inf_or_nan():
    prox, behav, keep = _ratios([[60.0, 60.0, 60.0]])
    w, stats = behaviour_weights(prox, behav, keep, Correction("sequence", "mask", 5.0))
    assert torch.equal(w, torch.zeros_like(w)) and math.isfinite(stats["is_weight_mean"])


def test_icepop_masks_tokens_outside_one_over_beta_to_beta():
    prox, behav, keep = _ratios([[math.log(0.3), math.log(0.6), 0.0, math.log(1.9), math.log(2.5)]])
    w, stats = behaviour_weights(prox, behav, keep, Correction("token", "truncate", None, icepop_beta=2.0))
    assert torch.allclose(w, torch.tensor([[0.0, 0.6, 1.0, 1.9, 0.0]]))
    assert stats["icepop_masked_fraction"] == pytest.approx(2 / 5)


@settings(max_examples=200, deadline=None)
@given(d=st.lists(st.floats(-3, 3), min_size=1, max_size=30), tau=st.floats(0.001, 1.0))
def test_m2po_drops_the_fewest_largest_squares_that_bring_the_second_moment_under_tau(d, tau):
    x = torch.tensor([d])
    keep = torch.ones_like(x, dtype=torch.bool)
    dropped = second_moment_mask(x, keep, tau)
    rest = x[~dropped]
    assert rest.numel() == 0 or float((rest**2).mean()) <= tau + 1e-6
    k = int(dropped.sum())
    # one fewer dropped (the smallest of those dropped kept) is over tau: the fewest
    if 0 < k < len(d):
        smallest = float((x[dropped] ** 2).min())
        assert (float((rest**2).sum()) + smallest) / (rest.numel() + 1) > tau - 1e-6
    # the dropped are the largest squares
    if k:
        assert float((x[dropped] ** 2).min()) >= float((rest**2).max() if rest.numel() else 0) - 1e-6


def test_corrections_refuse_bad_values_naming_the_key():
    for bad, key in (
        (dict(level="seq"), "is_level"),
        (dict(mode="clip"), "is_mode"),
        (dict(cap=0.5), "is_cap"),
        (dict(icepop_beta=0.9), "icepop_beta"),
        (dict(m2po_tau=-1.0), "m2po_tau"),
    ):
        with pytest.raises(ValueError, match=key):
            Correction(**bad)


def test_the_loss_gives_a_masked_sequence_no_gradient():
    logp = torch.zeros(2, 3, requires_grad=True)
    # row 1: sequence log-ratio 9, far over the cap
    prox = torch.tensor([[0.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
    loss, stats = decoupled_ppo_loss(
        logp,
        prox,
        torch.zeros(2, 3),
        torch.tensor([1.0, 1.0]),
        torch.ones(2, 3),
        is_cap=5.0,
        is_mode="mask",
        is_level="sequence",
    )
    loss.backward()
    assert torch.count_nonzero(logp.grad[1]) == 0 and torch.count_nonzero(logp.grad[0]) == 3
    assert stats["is_masked_fraction"] == pytest.approx(0.5)


def test_mismatch_is_the_k3_kl_of_current_version_tokens_and_split_by_staleness():
    prox = torch.tensor([[0.1, 0.1, 0.0], [0.0, -0.2, 0.0]])
    behav = torch.tensor([[0.1, 0.1, 0.0], [0.0, 0.0, 0.0]])
    keep = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    versions = torch.tensor([[7, 7, -1], [5, 5, -1]])
    out = mismatch(prox, behav, keep, versions, trainer_version=7)
    # version 7's tokens: trainer and sampler agree
    assert out["mismatch_kl"] == 0.0
    d = torch.tensor([0.0, -0.2])
    assert out["mismatch_kl_by_staleness"]["2"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-5)
    assert set(out["mismatch_kl_by_staleness"]) == {"0", "2"}
    # none of version 9
    assert mismatch(prox, behav, keep, versions, trainer_version=9)["mismatch_kl"] is None


def test_mismatch_of_log_probs_a_millionth_apart_is_their_half_square_not_rounding_noise():
    """vLLM's log-probs differ from the trainer's by ~1e-6 (CI's vLLM step): k3 ≈ d²/2 = 5e-13 must come out as
    that, not as float32's cancellation noise (zero or negative)."""
    behav = torch.full((1, 64), -1.5)
    d = torch.linspace(-2e-6, 2e-6, 64).double()
    prox = (behav.double() + d).float()
    true = float((((prox.double() - behav.double()) ** 2) / 2).mean())
    kl = mismatch(prox, behav, torch.ones(1, 64, dtype=torch.bool), torch.zeros(1, 64, dtype=torch.long), 0)
    assert kl["mismatch_kl"] == pytest.approx(true, rel=1e-3, abs=0) and true > 1e-13


def test_version_spans_count_the_versions_a_response_crossed():
    eps = [
        SimpleNamespace(versions=[3, 3, 4, 5]),
        SimpleNamespace(versions=[-1, 4, -1]),
        SimpleNamespace(versions=[-1]),
    ]
    assert version_spans(eps) == {"version_span_max": 3, "version_span_mean": 2.0}
    assert version_spans([]) == {"version_span_max": 0, "version_span_mean": 0.0}
