"""One cell of the staleness benchmark (bench/learning/staleness.py): the task and its held-out split, the warm-started
model, sampling by version v − η, the trainer's own step, the greedy evaluation. In one process, no Redis."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.trainer.batch import build_batch
from services.trainer.step import StepConfig, train_on_batch
from shared.protocol.episode.fold import Episode
from shared.protocol.episode.logprobs import token_logprobs
from shared.runtime.config.keys import Config

# name -> the StepConfig changes from the config's defaults (token level, mask, cap 5)
CORRECTIONS = {
    "default": {},
    "none": {"is_cap": None},
    "token-truncate": {"is_mode": "truncate"},
    "sequence-truncate": {"is_level": "sequence", "is_mode": "truncate"},
    "sequence-mask": {"is_level": "sequence", "is_mode": "mask"},
    "geometric-truncate": {"is_level": "geometric", "is_mode": "truncate", "is_cap": 2.0},
    "geometric-mask": {"is_level": "geometric", "is_mode": "mask", "is_cap": 2.0},
    "icepop": {"is_cap": None, "icepop_beta": 2.0},
    "m2po": {"is_cap": None, "m2po_tau": 0.04},
}
ETAS = (0, 1, 2, 4, 8, 16, 32)
# --corrections by default
GRID = ("default", "none", "token-truncate", "m2po", "sequence-truncate", "geometric-truncate")


@dataclass
class Setup:
    steps: int = 80
    lr: float = 3e-4
    group_size: int = 8
    batch_groups: int = 8
    max_tokens: int = 32
    temperature: float = 1.0
    # greedy-evaluate every this many versions ...
    eval_every: int = 5
    # ... over the last this many such versions (the eval is their mean)
    eval_last: int = 5
    # greedy tokens per held-out problem (the longest 4-term reference is 9)
    eval_tokens: int = 12

    @classmethod
    def from_defaults(cls, **changes) -> "Setup":
        c = Config()
        return replace(
            cls(
                lr=c.lr,
                group_size=c.group_size,
                batch_groups=c.batch_groups,
                max_tokens=c.max_tokens,
                temperature=c.temperature,
            ),
            **changes,
        )


def split_task(terms: int, eval_size: int, seed: int = 999_999) -> tuple[list[dict], list[dict]]:
    """(training pool, held-out rows) of chain sums of ``terms`` one-digit numbers (``3+4+5+6=``, 10^terms distinct
    problems; services/driver/tasks.py's chain_sum with a fixed length, its reference writes the running sums),
    ``eval_size`` of them held out at random; the warm start and training draw only from the pool, so the
    evaluation's problems are distinct and never trained on."""
    import itertools
    import random

    every = [
        {"prompt": "+".join(map(str, t)) + "=", "answer": str(sum(t))}
        for t in itertools.product(range(10), repeat=terms)
    ]
    if not 0 < eval_size <= len(every) // 2:
        raise ValueError(
            f"--eval-size {eval_size}: expected 1..{len(every) // 2} (half of the {len(every)} distinct "
            f"problems at --terms {terms}; the rest trains)"
        )
    held = set(random.Random(seed).sample(range(len(every)), eval_size))
    return [r for i, r in enumerate(every) if i not in held], [every[i] for i in sorted(held)]


def draw(pool: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` rows drawn from ``pool`` with replacement (seeded)."""
    import random

    rng = random.Random(seed)
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


def make_model(out_dir: Path, pool: list[dict], warm_steps: int, seed: int) -> str:
    """The default model's shape and recipe (services/ops/launch/tiny_model.py), warm-started on ``pool`` only."""
    from services.ops.launch.default_model import DEFAULT_MODEL, sft_examples, warm_start
    from services.ops.launch.tiny_model import load_tokenizer, make_tiny_model

    make_tiny_model(out_dir, **DEFAULT_MODEL, seed=seed)
    if warm_steps > 0:
        warm_start(
            out_dir, sft_examples(draw(pool, 4096, seed + 12345), load_tokenizer(out_dir)), warm_steps, seed=seed
        )
    return str(out_dir)


def step_config(correction: str) -> StepConfig:
    """The StepConfig of ``correction``: a name of CORRECTIONS, optionally with changes, ``name:field=value:...``
    (``m2po:m2po_tau=0.02``, ``token-truncate:is_cap=2``)."""
    name, *changes = correction.split(":")
    if name not in CORRECTIONS:
        raise ValueError(f"--corrections: unknown {name!r}; expected some of {', '.join(CORRECTIONS)}")
    sc = replace(StepConfig.from_config(Config()), **CORRECTIONS[name])
    for change in changes:
        key, _, value = change.partition("=")
        if key not in StepConfig.__dataclass_fields__ or not value:
            raise ValueError(
                f"--corrections: {correction!r}: expected field=value with a field of StepConfig "
                f"({', '.join(StepConfig.__dataclass_fields__)}), got {change!r}"
            )
        old = getattr(sc, key)
        sc = replace(sc, **{key: None if value == "none" else type(old if old is not None else 1.0)(value)})
    return sc


def behaviour_version(v: int, eta: int) -> int:
    """The version that samples the batch trained at version ``v``: v − η, or 0 before version η exists."""
    return max(v - eta, 0)


def by_width(prompts: list[list[int]]) -> dict[int, list[int]]:
    """Row indices per prompt length: each length is one batch of equal-width prompts (no padding)."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        out.setdefault(len(p), []).append(i)
    return out


@torch.no_grad()
def sample(
    model,
    tok,
    rows: list[dict],
    n: int,
    version: int,
    max_tokens: int,
    temperature: float,
    gen: torch.Generator,
    group_offset: int = 0,
) -> list[list[Episode]]:
    """One group of ``n`` sampled episodes per row, each token's behaviour log-prob and version recorded;
    rewards by the default reward function. Rows are sampled one prompt length at a time."""
    from services.rollout.jobs.rewards import arithmetic

    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    eos = tok.eos_token_id
    groups: list[list[Episode] | None] = [None] * len(rows)
    for width, idx in by_width(prompts).items():
        ids = torch.tensor([prompts[g] for g in idx for _ in range(n)])
        done = torch.zeros(len(ids), dtype=torch.bool)
        seq = ids
        # plain sampling loop, full forward each token (tiny model, short answers)
        for _ in range(max_tokens):
            logits = model(input_ids=seq).logits[:, -1].float() / temperature
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
            nxt = torch.where(done, tok.pad_token_id, nxt)
            seq = torch.cat([seq, nxt[:, None]], 1)
            done |= nxt == eos
            if done.all():
                break
        logp = token_logprobs(model(input_ids=seq).logits[:, :-1], seq[:, 1:], temperature)
        for j, g in enumerate(idx):
            row, group = rows[g], []
            for i in range(n):
                k = j * n + i
                resp = seq[k, width:].tolist()
                stop = resp.index(eos) + 1 if eos in resp else len(resp)
                resp = resp[:stop]
                reward = arithmetic(tok.decode(resp, skip_special_tokens=True), row)[0]
                group.append(
                    Episode(
                        f"e{group_offset + g}-{i}",
                        f"g{group_offset + g}",
                        i,
                        prompts[g],
                        {"temperature": temperature},
                        row,
                        tokens=resp,
                        logprobs=logp[k, width - 1 : width - 1 + stop].tolist(),
                        versions=[version] * stop,
                        mask=[1] * stop,
                        status="finished",
                        finish_reason="stop" if stop and resp[-1] == eos else "length",
                        reward=reward,
                    )
                )
            groups[g] = group
    return groups


@torch.no_grad()
def greedy_eval(model, tok, rows: list[dict], max_tokens: int = 8) -> float:
    """Share of ``rows`` the greedy policy answers right (default reward), one prompt length at a time."""
    from services.rollout.jobs.rewards import arithmetic

    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    eos, right = tok.eos_token_id, 0
    for width, idx in by_width(prompts).items():
        seq = torch.tensor([prompts[k] for k in idx])
        for _ in range(max_tokens):
            seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        for j, k in enumerate(idx):
            resp = seq[j, width:].tolist()
            resp = resp[: resp.index(eos)] if eos in resp else resp
            right += arithmetic(tok.decode(resp, skip_special_tokens=True), rows[k])[0] == 1.0
    return right / len(rows)


def start_cell(model_dir: str, correction: str, seed: int, setup: "Setup", pool: list[dict]):
    """A cell's starting point, the same for every task: (tokenizer, the trained model, the behaviour model, its
    AdamW, the correction's step config, the sampling generator, the cell's rows drawn from ``pool``, the version
    snapshots {0: the initial weights})."""
    from transformers import AutoModelForCausalLM

    from services.ops.launch.tiny_model import load_tokenizer

    torch.manual_seed(seed)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    behaviour = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    rows = draw(pool, setup.steps * setup.batch_groups, seed + 1)
    return (
        tok,
        model,
        behaviour,
        opt,
        step_config(correction),
        torch.Generator().manual_seed(seed),
        rows,
        {0: copy.deepcopy(model.state_dict())},
    )


def run_cell(
    model_dir: str,
    eta: int,
    correction: str,
    seed: int,
    setup: Setup,
    eval_rows: list[dict],
    pool: list[dict],
    on_step=None,
) -> dict:
    """Train ``setup.steps`` versions at staleness exactly η; return the reward curve, the greedy eval (the mean
    over the last ``setup.eval_last`` versions evaluated, every ``setup.eval_every``-th; ``eval_final`` the last
    version's) and the per-step behaviour versions and mismatch figures."""
    tok, model, behaviour, opt, sc, gen, rows, snapshots = start_cell(model_dir, correction, seed, setup, pool)
    curve, behav_versions, mismatch0, masked, eval_curve = [], [], [], [], []
    for v in range(setup.steps):
        bv = behaviour_version(v, eta)
        behaviour.load_state_dict(snapshots[bv])
        chunk = rows[v * setup.batch_groups : (v + 1) * setup.batch_groups]
        groups = sample(
            behaviour,
            tok,
            chunk,
            setup.group_size,
            bv,
            setup.max_tokens,
            setup.temperature,
            gen,
            v * setup.batch_groups,
        )
        batch = build_batch(groups, tok.pad_token_id, trainer_version=v)
        stats = train_on_batch(model, opt, batch, sc)
        snapshots[v + 1] = copy.deepcopy(model.state_dict())
        # keep the last η + 1
        snapshots.pop(v + 1 - eta - 1, None)
        reward = float(batch.rewards.mean())
        curve.append(reward)
        behav_versions.append(int(batch.versions[batch.loss_mask > 0].unique().item()))
        mismatch0.append(stats.get("mismatch_kl"))
        masked.append(
            sum(stats.get(k, 0.0) for k in ("is_masked_fraction", "icepop_masked_fraction", "m2po_masked_fraction"))
        )
        if (v + 1) % setup.eval_every == 0 and v + 1 > setup.steps - setup.eval_every * setup.eval_last:
            eval_curve.append((v + 1, greedy_eval(model.eval(), tok, eval_rows, setup.eval_tokens)))
        if on_step:
            on_step(v, reward, stats)
    return {
        "eta": eta,
        "correction": correction,
        "seed": seed,
        "curve": curve,
        "behaviour_versions": behav_versions,
        "eval": sum(a for _, a in eval_curve) / len(eval_curve),
        "eval_final": eval_curve[-1][1],
        "eval_curve": eval_curve,
        "mismatch_kl_current": mismatch0,
        "masked_fraction": masked,
        "snapshots_kept": len(snapshots),
    }
