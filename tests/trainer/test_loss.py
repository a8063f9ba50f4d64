"""Losses: decoupled PPO reduces to PPO-clip on-policy, truncation, masking, clipping, aggregation, GRPO."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.objective.loss import (
    AGGREGATIONS,
    decoupled_ppo_loss,
    entropy_from_logits,
    grpo_advantages,
    ppo_clip_loss,
    token_logprobs,
)

SETTINGS = settings(max_examples=60, deadline=None)
aggs = st.sampled_from(AGGREGATIONS)
clips = st.sampled_from([0.1, 0.2, 0.28])


def _case(seed: int, b: int, t: int, per_token_adv: bool, spread: float = 0.5) -> dict[str, torch.Tensor]:
    """Random float64 inputs; behav is prox shifted by up to ±2·spread so importance weights vary."""
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = prox + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * spread
    behav = prox + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 4 * spread
    adv = torch.randn((b, t) if per_token_adv else (b,), generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) < 0.7).double()
    # at least one unmasked token
    mask[0, 0] = 1.0
    return {"logp": logp.requires_grad_(), "prox": prox, "behav": behav, "adv": adv, "mask": mask}


def _grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


cases = st.builds(_case, st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 7), st.booleans())


# --- decoupled PPO vs PPO-clip


@SETTINGS
@given(c=cases, agg=aggs, lo=clips, hi=clips, cap=st.sampled_from([None, 1.0, 5.0]))
def test_on_policy_decoupled_equals_ppo_clip_exactly(c, agg, lo, hi, cap):
    ref, ref_stats = ppo_clip_loss(c["logp"], c["prox"], c["adv"], c["mask"], lo, hi, agg)
    got, stats = decoupled_ppo_loss(c["logp"], c["prox"], c["prox"].clone(), c["adv"], c["mask"], lo, hi, cap, agg)
    assert torch.equal(got, ref)
    assert torch.equal(_grad(got, c["logp"]), _grad(ref, c["logp"]))
    assert stats["clip_fraction"] == ref_stats["clip_fraction"]
    assert stats["approx_kl"] == ref_stats["approx_kl"]
    assert stats["is_weight_mean"] == stats["is_weight_max"] == 1.0
    assert stats["is_truncated_fraction"] == 0.0


@SETTINGS
@given(c=cases, agg=aggs, lo=clips, hi=clips, cap=st.sampled_from([1.0, 1.5, 3.0]))
def test_truncated_loss_equals_loss_with_manually_clamped_weights(c, agg, lo, hi, cap):
    logp, prox, behav, adv, mask = c["logp"], c["prox"], c["behav"], c["adv"], c["mask"]
    got, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, lo, hi, cap, agg)
    w = torch.exp(prox - behav).clamp(max=cap)
    # 1) the same decoupled loss, untruncated, on a behaviour policy whose weights are already clamped
    same, _ = decoupled_ppo_loss(logp, prox, prox - torch.log(w), adv, mask, lo, hi, None, agg)
    # 2) w > 0 folds into the advantage: w·min(rA, clip(r)A) = min(r·wA, clip(r)·wA)
    per_token = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    folded, _ = ppo_clip_loss(logp, prox, per_token * w, mask, lo, hi, agg)
    got_grad = _grad(got, logp)
    for other in (same, folded):
        torch.testing.assert_close(got, other, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_grad, _grad(other, logp), rtol=1e-12, atol=1e-12)


@SETTINGS
@given(c=cases, cap=st.sampled_from([1.0, 1.2, 2.0, 5.0]))
def test_truncation_caps_the_weight_and_counts_truncated_tokens(c, cap):
    _, stats = decoupled_ppo_loss(c["logp"], c["prox"], c["behav"], c["adv"], c["mask"], is_cap=cap)
    raw = [
        math.exp(p - b)
        for p, b, m in zip(c["prox"].flatten().tolist(), c["behav"].flatten().tolist(), c["mask"].flatten().tolist())
        if m
    ]
    clamped = [min(w, cap) for w in raw]
    assert stats["is_weight_max"] <= cap
    assert stats["is_weight_max"] == pytest.approx(max(clamped), rel=1e-12)
    assert stats["is_weight_mean"] == pytest.approx(sum(clamped) / len(clamped), rel=1e-12)
    assert stats["is_truncated_fraction"] == pytest.approx(sum(w > cap for w in raw) / len(raw), abs=1e-12)
    _, uncapped = decoupled_ppo_loss(c["logp"], c["prox"], c["behav"], c["adv"], c["mask"], is_cap=None)
    assert uncapped["is_weight_max"] == pytest.approx(max(raw), rel=1e-12)
    assert uncapped["is_truncated_fraction"] == 0.0


def test_truncation_hand_example():
    prox = torch.zeros(1, 4, dtype=torch.float64)
    # weights 0.5, 2, 8, 100
    behav = -torch.log(torch.tensor([[0.5, 2.0, 8.0, 100.0]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    logp = prox.clone().requires_grad_()
    loss, stats = decoupled_ppo_loss(logp, prox, behav, torch.tensor([1.0], dtype=torch.float64), mask, is_cap=5.0)
    assert stats["is_weight_max"] == pytest.approx(5.0)
    assert stats["is_truncated_fraction"] == pytest.approx(1 / 3)
    assert stats["is_weight_mean"] == pytest.approx((0.5 + 2 + 5) / 3)
    # ratio 1, A = 1: objective = weight
    assert loss.item() == pytest.approx(-(0.5 + 2 + 5) / 3)
    assert _grad(loss, logp)[0].tolist() == pytest.approx([-0.5 / 3, -2 / 3, -5 / 3, 0.0])


def test_only_logp_receives_gradient():
    c = _case(3, 3, 5, True, spread=2.0)
    prox, behav = c["prox"].clone().requires_grad_(), c["behav"].clone().requires_grad_()
    loss, _ = decoupled_ppo_loss(c["logp"], prox, behav, c["adv"], c["mask"], is_cap=None)
    assert torch.autograd.grad(loss, [prox, behav], allow_unused=True) == (None, None)
    loss, _ = ppo_clip_loss(c["logp"], behav, c["adv"].requires_grad_(), c["mask"])
    assert torch.autograd.grad(loss, [behav, c["adv"]], allow_unused=True) == (None, None)


def test_is_cap_below_one_is_rejected():
    c = _case(0, 2, 3, False)
    with pytest.raises(ValueError, match="is_cap"):
        decoupled_ppo_loss(c["logp"], c["prox"], c["behav"], c["adv"], c["mask"], is_cap=0.5)


# --- masking

GARBAGE = [float("nan"), float("inf"), float("-inf"), 1e30, -1e30]


@SETTINGS
@given(c=cases, agg=aggs, decoupled=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_masked_tokens_contribute_nothing(c, agg, decoupled, seed):
    mask = c["mask"]
    g = torch.Generator().manual_seed(seed)

    def spoil(x: torch.Tensor) -> torch.Tensor:
        junk = torch.tensor(GARBAGE, dtype=x.dtype)[torch.randint(len(GARBAGE), x.shape, generator=g)]
        return torch.where(mask.bool(), x.detach(), junk)

    def run(logp, prox, behav, adv):
        if decoupled:
            return decoupled_ppo_loss(logp, prox, behav, adv, mask, agg=agg)
        return ppo_clip_loss(logp, behav, adv, mask, agg=agg)

    clean_loss, clean_stats = run(c["logp"], c["prox"], c["behav"], c["adv"])
    clean_grad = _grad(clean_loss, c["logp"])
    dirty_logp = spoil(c["logp"]).requires_grad_()
    dirty_adv = spoil(c["adv"]) if c["adv"].dim() == 2 else c["adv"]
    dirty_loss, dirty_stats = run(dirty_logp, spoil(c["prox"]), spoil(c["behav"]), dirty_adv)
    dirty_grad = _grad(dirty_loss, dirty_logp)
    assert torch.isfinite(dirty_loss)
    assert torch.equal(dirty_loss, clean_loss)
    assert torch.equal(dirty_grad, clean_grad)
    assert torch.all(dirty_grad[mask == 0] == 0)
    assert dirty_stats == clean_stats


def test_all_masked_batch_gives_zero_loss_and_zero_gradient():
    logp = torch.full((2, 3), float("nan"), requires_grad=True)
    mask = torch.zeros(2, 3)
    for agg in AGGREGATIONS:
        loss, stats = decoupled_ppo_loss(logp, logp.detach(), torch.zeros(2, 3), torch.ones(2), mask, agg=agg)
        assert loss.item() == 0.0
        assert torch.equal(_grad(loss, logp), torch.zeros(2, 3))
        assert stats == {
            "clip_fraction": 0.0,
            "approx_kl": 0.0,
            "is_weight_mean": 0.0,
            "is_weight_max": 0.0,
            "is_truncated_fraction": 0.0,
            "is_masked_fraction": 0.0,
            "icepop_masked_fraction": 0.0,
            "m2po_masked_fraction": 0.0,
        }


# --- clipping

ratios = st.floats(0.3, 2.5).filter(lambda r: all(abs(r - edge) > 1e-3 for edge in (0.72, 0.8, 0.9, 1.1, 1.2, 1.28)))
nonzero_adv = st.sampled_from([-2.0, -0.7, -0.1, 0.1, 0.7, 2.0])


@SETTINGS
@given(
    rows=st.lists(st.lists(st.tuples(ratios, nonzero_adv), min_size=1, max_size=6), min_size=1, max_size=3).filter(
        lambda rows: len({len(r) for r in rows}) == 1
    ),
    lo=clips,
    hi=clips,
    decoupled=st.booleans(),
)
def test_gradient_is_zero_exactly_where_the_clip_is_active(rows, lo, hi, decoupled):
    r = torch.tensor([[x for x, _ in row] for row in rows], dtype=torch.float64)
    a = torch.tensor([[y for _, y in row] for row in rows], dtype=torch.float64)
    old = -torch.ones_like(r)
    logp = (old + torch.log(r)).requires_grad_()
    mask = torch.ones_like(r)
    # far-off behaviour policy: the clip must still be centred on the proximal policy
    if decoupled:
        loss, stats = decoupled_ppo_loss(logp, old, old - 0.5, a, mask, lo, hi, is_cap=None)
    else:
        loss, stats = ppo_clip_loss(logp, old, a, mask, lo, hi)
    grad = _grad(loss, logp)
    clipped = ((a > 0) & (r > 1 + hi)) | ((a < 0) & (r < 1 - lo))
    weight = math.exp(0.5) if decoupled else 1.0
    assert torch.all(grad[clipped] == 0)
    torch.testing.assert_close(grad[~clipped], (-weight * a * r / r.numel())[~clipped], rtol=1e-9, atol=0)
    assert stats["clip_fraction"] == pytest.approx(clipped.double().mean().item())
    expected = torch.where(clipped, r.clamp(1 - lo, 1 + hi) * a, r * a)
    assert loss.item() == pytest.approx(-weight * expected.mean().item(), rel=1e-9)


# --- aggregation


def _agg_example():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 2.0, 9.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    logp = torch.full((3, 4), -1.0, requires_grad=True)
    return logp, adv, mask


@pytest.mark.parametrize(
    ("agg", "value", "grad_rows"),
    [
        # ratio 1, so the objective is A per token; the third sequence is fully masked
        ("token-mean", -(1 + 2 + 4) / 3, [[-1 / 3, -2 / 3], [-4 / 3]]),
        ("seq-mean-token-mean", -((1 + 2) / 2 + 4) / 2, [[-1 / 4, -2 / 4], [-4 / 2]]),
        ("seq-mean-token-sum", -((1 + 2) + 4) / 2, [[-1 / 2, -2 / 2], [-4 / 2]]),
    ],
)
def test_aggregation_hand_examples(agg, value, grad_rows):
    logp, adv, mask = _agg_example()
    for loss, _ in (
        ppo_clip_loss(logp, logp.detach(), adv, mask, agg=agg),
        decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, mask, agg=agg),
    ):
        assert loss.item() == pytest.approx(value)
        grad = _grad(loss, logp)
        assert grad[0, :2].tolist() == pytest.approx(grad_rows[0])
        assert grad[1, :1].tolist() == pytest.approx(grad_rows[1])
        assert torch.all(grad[mask == 0] == 0)


def test_per_sequence_advantages_broadcast_over_tokens():
    logp, _, mask = _agg_example()
    per_seq, _ = ppo_clip_loss(logp, logp.detach(), torch.tensor([1.0, -2.0, 5.0]), mask)
    per_token, _ = ppo_clip_loss(logp, logp.detach(), torch.tensor([1.0, -2.0, 5.0])[:, None].expand(3, 4), mask)
    assert per_seq.item() == per_token.item() == pytest.approx(-(1 + 1 - 2) / 3)


def test_unknown_agg_and_bad_shapes_are_value_errors():
    logp, adv, mask = _agg_example()
    with pytest.raises(ValueError) as err:
        ppo_clip_loss(logp, logp.detach(), adv, mask, agg="sum")
    assert "'sum'" in str(err.value) and all(a in str(err.value) for a in AGGREGATIONS)
    with pytest.raises(ValueError, match="unknown agg 'mean'"):
        decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, mask, agg="mean")
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(logp, logp.detach(), torch.ones(4), mask)
    with pytest.raises(ValueError, match="mask"):
        ppo_clip_loss(logp, logp.detach(), adv, mask[:, :3])


# --- stats


def test_approx_kl_is_k3_to_behaviour():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    behav = torch.tensor([[-1.5, -1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    # logp - behav on unmasked tokens
    d = [0.5, -1.0]
    k3 = sum(math.exp(x) - 1 - x for x in d) / 2
    _, stats = ppo_clip_loss(logp, behav, torch.ones(1, dtype=torch.float64), mask)
    assert stats["approx_kl"] == pytest.approx(k3)
    _, stats = decoupled_ppo_loss(logp, logp, behav, torch.ones(1, dtype=torch.float64), mask, is_cap=None)
    assert stats["approx_kl"] == pytest.approx(k3)
    assert all(type(v) is float for v in stats.values())


# --- GRPO advantages

reward_groups = st.lists(
    st.lists(st.sampled_from([0.0, 0.1, 0.7, 1.0, -1.0, 3.0]), min_size=1, max_size=8), min_size=1, max_size=5
)


@SETTINGS
@given(groups=reward_groups)
def test_grpo_advantages_are_zero_mean_unit_std_and_zero_for_constant_groups(groups):
    adv = grpo_advantages(groups)
    assert adv.shape == (sum(map(len, groups)),)
    for chunk, rewards in zip(adv.split([len(g) for g in groups]), groups):
        if len(set(rewards)) == 1:
            assert torch.equal(chunk, torch.zeros(len(rewards)))
        else:
            assert float(chunk.sum()) == pytest.approx(0.0, abs=1e-5)
            assert float(chunk.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
            # order-preserving: a higher reward never gets a lower advantage
            pairs = sorted(zip(rewards, chunk.tolist()))
            assert all(a2 >= a1 for (_, a1), (_, a2) in zip(pairs, pairs[1:]))


@SETTINGS
@given(g=st.integers(1, 4), n=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_grpo_tensor_input_matches_list_input(g, n, seed):
    rewards = torch.randint(0, 3, (g, n), generator=torch.Generator().manual_seed(seed)).float()
    adv = grpo_advantages(rewards)
    assert adv.shape == (g, n)
    assert torch.equal(adv.flatten(), grpo_advantages(rewards.tolist()))
    centred = grpo_advantages(rewards, normalize_std=False)
    torch.testing.assert_close(centred, rewards - rewards.mean(dim=1, keepdim=True))


def test_grpo_hand_example():
    adv = grpo_advantages(torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]), eps=0.0)
    assert adv.tolist() == [[-1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert grpo_advantages([[1.0, 0.0, 0.0, 0.0]], eps=0.0).tolist() == pytest.approx(
        [0.75 / math.sqrt(0.1875), -0.25 / math.sqrt(0.1875), -0.25 / math.sqrt(0.1875), -0.25 / math.sqrt(0.1875)]
    )
    assert grpo_advantages([[7.0]]).tolist() == [0.0]


# --- log-probs and entropy


def test_token_logprobs_hand_example_and_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])
    ids = torch.tensor([[1, 0]])
    assert token_logprobs(logits, ids)[0].tolist() == pytest.approx([math.log(0.75), math.log(0.5)])
    # temperature 2 halves the logits: p(1) = sqrt(3) / (1 + sqrt(3))
    expected = [math.log(math.sqrt(3) / (1 + math.sqrt(3))), math.log(0.5)]
    assert token_logprobs(logits, ids, 2.0)[0].tolist() == pytest.approx(expected)
    assert token_logprobs(logits, ids, torch.tensor([2.0]))[0].tolist() == pytest.approx(expected)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), temp=st.sampled_from([0.5, 1.0, 1.7]))
def test_token_logprobs_matches_log_softmax_gather(seed, temp):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 4
    ids = torch.randint(11, (2, 5), generator=g)
    ref = torch.log_softmax(logits / temp, dim=-1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, ids, temp), ref.float())


def test_entropy_from_logits_is_masked_mean():
    logits = torch.zeros(1, 3, 4)
    # nearly deterministic: entropy ~ 0
    logits[0, 1] = torch.tensor([100.0, 0.0, 0.0, 0.0])
    # masked garbage
    logits[0, 2] = float("nan")
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert float(entropy_from_logits(logits, mask)) == pytest.approx(math.log(4) / 2, abs=1e-6)
    assert float(entropy_from_logits(logits, torch.zeros(1, 3))) == 0.0


# --- importance-weight cap: mask vs truncate; dual clip; micro-batch denominators


def test_mask_mode_drops_tokens_over_the_cap_hand_example():
    prox = torch.zeros(1, 4, dtype=torch.float64)
    # weights 0.5, 2, 8, 100
    behav = -torch.log(torch.tensor([[0.5, 2.0, 8.0, 100.0]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    logp = prox.clone().requires_grad_()
    loss, stats = decoupled_ppo_loss(
        logp, prox, behav, torch.tensor([1.0], dtype=torch.float64), mask, is_cap=5.0, is_mode="mask"
    )
    assert stats["is_masked_fraction"] == pytest.approx(1 / 3) and stats["is_truncated_fraction"] == 0.0
    assert stats["is_weight_max"] == pytest.approx(2.0)
    # the token stays in the denominator
    assert loss.item() == pytest.approx(-(0.5 + 2 + 0) / 3)
    assert _grad(loss, logp)[0].tolist() == pytest.approx([-0.5 / 3, -2 / 3, 0.0, 0.0])
    with pytest.raises(ValueError, match="is_mode"):
        decoupled_ppo_loss(logp, prox, behav, torch.ones(1, dtype=torch.float64), mask, is_mode="clip")


@pytest.mark.parametrize("decoupled", [False, True])
def test_dual_clip_bounds_a_runaway_ratio_with_negative_advantage(decoupled):
    old = torch.zeros(1, 2, dtype=torch.float64)
    # ratios e^5 and e^0.05
    logp = torch.tensor([[5.0, 0.05]], dtype=torch.float64, requires_grad=True)
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)

    def run(c):
        if decoupled:
            return decoupled_ppo_loss(logp, old, old, adv, mask, is_cap=None, clip_ratio_c=c)
        return ppo_clip_loss(logp, old, adv, mask, clip_ratio_c=c)

    loss, stats = run(3.0)
    grad = _grad(loss, logp)
    # the dual clip holds the runaway token
    assert grad[0, 0] == 0.0 and grad[0, 1] != 0.0
    assert loss.item() == pytest.approx(-(-3.0 - math.exp(0.05)) / 2)
    assert stats["clip_fraction"] == 0.5
    free, _ = run(None)
    # unbounded without it
    assert _grad(free, logp)[0, 0] == pytest.approx(math.exp(5.0) / 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run(0.5)


@SETTINGS
@given(c=cases, agg=aggs, decoupled=st.booleans(), cut=st.integers(1, 3))
def test_micro_batches_with_the_batch_denominator_sum_to_the_batch_loss(c, agg, decoupled, cut):
    from services.trainer.objective.loss import aggregate_denominator

    b = c["logp"].shape[0]
    cut = min(cut, b)

    def loss_of(rows, denom=None):
        args = [c[k][rows] for k in ("logp", "prox", "behav", "adv", "mask")]
        if decoupled:
            return decoupled_ppo_loss(*args, agg=agg, denom=denom)[0]
        return ppo_clip_loss(args[0], args[2], args[3], args[4], agg=agg, denom=denom)[0]

    whole = loss_of(slice(0, b))
    denom = aggregate_denominator(c["mask"], agg)
    parts = loss_of(slice(0, cut), denom) + loss_of(slice(cut, b), denom)
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_grad(parts, c["logp"]), _grad(whole, c["logp"]), rtol=1e-12, atol=1e-12)
