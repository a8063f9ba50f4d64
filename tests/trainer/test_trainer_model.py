"""The trainer's model options: LoRA publishes merged weights, the KL reference stays frozen, bf16 autocast
computes in bf16 over fp32 weights, gradient checkpointing gives the same gradients."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.trainer.model import load_policy
from services.trainer.objective import kl
from shared.protocol.episode.logprobs import token_logprobs
from shared.runtime.config.keys import Config


def _batch(vocab: int, b: int = 2, t: int = 12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    return ids, torch.ones_like(ids), ids[:, 1:]


def test_k1_and_k3():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -2.0, -0.1]])
    mask = torch.tensor([[1, 1, 0]])
    assert torch.allclose(kl.kl_per_token(logp, ref, "k1"), logp - ref)
    k3 = kl.kl_per_token(logp, ref, "k3")
    assert (k3 >= 0).all() and k3[0, 1] == 0
    assert torch.isclose(kl.kl_term(logp, ref, mask, "k3"), (k3[0, 0] + k3[0, 1]) / 2)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl.kl_per_token(logp, ref, "k2")


def test_lora_publishes_merged_weights_under_base_names(tiny_model_dir):
    policy = load_policy(Config(model_dir=tiny_model_dir, lora_rank=4, lora_alpha=8.0))
    # adapters start as a no-op (B = 0): give them a value
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    state = policy.publish_state()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert set(state) == set(base.state_dict())
    ids, attn, _ = _batch(100)
    with torch.no_grad():
        want = policy.model(input_ids=ids, attention_mask=attn).logits
        base.load_state_dict(state)
        got = base(input_ids=ids, attention_mask=attn).logits
    assert torch.allclose(want, got, atol=1e-5)
    assert not torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"],
        AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )


@pytest.mark.parametrize("lora", [0, 4])
def test_kl_reference_stays_frozen_and_starts_at_zero(tiny_model_dir, lora):
    """Rows sampled with top-k and with top-p: the reference's log-probs use each row's transform as the policy's
    do (one definition), so the KL is 0 while the policy is the reference, on every row."""
    policy = load_policy(Config(model_dir=tiny_model_dir, kl_coef=0.5, lora_rank=lora))
    ids, attn, targets = _batch(100)
    temp, top_k, top_p = torch.tensor([0.7, 1.0]), torch.tensor([5, 0]), torch.tensor([1.0, 0.8])
    mask = torch.ones_like(targets)
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=0.5)
    ref_before = policy.reference_logprobs(ids, attn, targets, temp, top_k, top_p)
    mb = SimpleNamespace(
        input_ids=ids,
        attention_mask=attn,
        targets=targets,
        temperature=temp,
        top_k=top_k,
        # the fields of a trainer Batch the penalty reads
        top_p=top_p,
        loss_mask=mask,
    )
    for step in range(2):
        logits = policy.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = token_logprobs(logits, targets, temp, top_k, top_p)
        # kl_coef x token-mean KL over the rows
        penalty = policy.kl_penalty()(mb, logp, "cpu")
        loss, stats = -logp.mean() + penalty, {"kl": float(penalty.detach()) / 0.5}
        if step == 0:
            # policy = reference at the start
            assert stats["kl"] == pytest.approx(0.0, abs=1e-6)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert stats["kl"] > 0
    assert torch.equal(policy.reference_logprobs(ids, attn, targets, temp, top_k, top_p), ref_before)
    if not lora:
        assert not any(p.requires_grad for p in policy.reference.parameters())


def test_bf16_autocast_keeps_fp32_weights_and_checkpointing_keeps_gradients(tiny_model_dir):
    plain = load_policy(Config(model_dir=tiny_model_dir))
    ckpt = load_policy(Config(model_dir=tiny_model_dir, grad_checkpointing=True))
    bf16 = load_policy(Config(model_dir=tiny_model_dir, dtype="bfloat16"))
    ids, attn, targets = _batch(100)
    grads = []
    for policy in (plain, ckpt):
        logits = policy.model(input_ids=ids, attention_mask=attn).logits
        token_logprobs(logits[:, :-1], targets).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    logits = bf16.model(input_ids=ids, attention_mask=attn).logits
    assert logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    logits.float().mean().backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in bf16.model.parameters())
