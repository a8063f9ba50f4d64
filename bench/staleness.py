"""Staleness tolerance, with staleness fixed exactly (issue 32): in one process, no Redis, no pipeline.

Every step v the batch is sampled by policy version v − η (the harness keeps the last η + 1 snapshots; for
v < η, before any older version exists, by version 0, so staleness is min(v, η)), its behaviour log-probs
recorded under that version's weights (``token_logprobs``, the rollout engines' definition), and the trainer at
version v trains on it with the chosen correction (the trainer's own ``build_batch`` + ``train_on_batch``),
then publishes v + 1. At the end: greedy accuracy on held-out problems; mean ± standard error over seeds.

The model and task are the default run's (services/ops/tiny_model.py's default model, the arithmetic task and
its reward); the step's hyper-parameters are the config's defaults (lr, group size, groups per batch,
temperature, max tokens) unless given.

    python bench/staleness.py                       # the grid (long: see bench/RESULTS.md)
    python bench/staleness.py --etas 0,8 --corrections default,none --seeds 1 --steps 20   # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.trainer.batch import build_batch  # noqa: E402
from services.trainer.step import StepConfig, train_on_batch  # noqa: E402
from shared.protocol.fold import Episode  # noqa: E402
from shared.protocol.logprobs import token_logprobs  # noqa: E402
from shared.runtime.config import Config  # noqa: E402

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


@dataclass
class Setup:
    steps: int = 60
    lr: float = 3e-4
    group_size: int = 8
    batch_groups: int = 8
    max_tokens: int = 32
    temperature: float = 1.0

    @classmethod
    def from_defaults(cls, **changes) -> "Setup":
        c = Config()
        return replace(cls(lr=c.lr, group_size=c.group_size, batch_groups=c.batch_groups, max_tokens=c.max_tokens,
                           temperature=c.temperature), **changes)


def step_config(correction: str) -> StepConfig:
    if correction not in CORRECTIONS:
        raise ValueError(f"--corrections: unknown {correction!r}; expected some of {', '.join(CORRECTIONS)}")
    return replace(StepConfig.from_config(Config()), **CORRECTIONS[correction])


def behaviour_version(v: int, eta: int) -> int:
    """The version that samples the batch trained at version ``v``: v − η, or 0 before version η exists."""
    return max(v - eta, 0)


@torch.no_grad()
def sample(model, tok, rows: list[dict], n: int, version: int, max_tokens: int, temperature: float,
           gen: torch.Generator, group_offset: int = 0) -> list[list[Episode]]:
    """One group of ``n`` sampled episodes per row (prompts of equal length), each token's behaviour log-prob
    and version recorded; rewards by the default reward function."""
    from services.rollout.jobs.rewards import arithmetic

    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    width = len(prompts[0])
    if any(len(p) != width for p in prompts):
        raise ValueError("sample: the arithmetic prompts must have one length")
    ids = torch.tensor([p for p in prompts for _ in range(n)])
    eos, done = tok.eos_token_id, torch.zeros(len(ids), dtype=torch.bool)
    seq = ids
    for _ in range(max_tokens):  # plain sampling loop, full forward each token (tiny model, short answers)
        logits = model(input_ids=seq).logits[:, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
        nxt = torch.where(done, tok.pad_token_id, nxt)
        seq = torch.cat([seq, nxt[:, None]], 1)
        done |= nxt == eos
        if done.all():
            break
    attn = torch.ones_like(seq)
    logits = model(input_ids=seq, attention_mask=attn).logits[:, :-1]
    logp = token_logprobs(logits, seq[:, 1:], temperature)
    groups = []
    for g, row in enumerate(rows):
        group = []
        for i in range(n):
            k = g * n + i
            resp = seq[k, width:].tolist()
            stop = resp.index(eos) + 1 if eos in resp else len(resp)
            resp = resp[:stop]
            text = tok.decode(resp, skip_special_tokens=True)
            reward = arithmetic(text, row)[0]
            group.append(Episode(f"e{group_offset + g}-{i}", f"g{group_offset + g}", i, prompts[g],
                                 {"temperature": temperature}, row, tokens=resp,
                                 logprobs=logp[k, width - 1:width - 1 + stop].tolist(), versions=[version] * stop,
                                 mask=[1] * stop, status="finished",
                                 finish_reason="stop" if stop and resp[-1] == eos else "length", reward=reward))
        groups.append(group)
    return groups


@torch.no_grad()
def greedy_eval(model, tok, rows: list[dict], max_tokens: int = 8) -> float:
    """Share of ``rows`` the greedy policy answers right (default reward)."""
    from services.rollout.jobs.rewards import arithmetic

    seq = torch.tensor([tok.encode(r["prompt"], add_special_tokens=False) for r in rows])
    width, eos = seq.shape[1], tok.eos_token_id
    for _ in range(max_tokens):
        seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    right = 0
    for k, row in enumerate(rows):
        resp = seq[k, width:].tolist()
        resp = resp[:resp.index(eos)] if eos in resp else resp
        right += arithmetic(tok.decode(resp, skip_special_tokens=True), row)[0] == 1.0
    return right / len(rows)


def run_cell(model_dir: str, eta: int, correction: str, seed: int, setup: Setup, eval_rows: list[dict],
             on_step=None) -> dict:
    """Train ``setup.steps`` versions at staleness exactly η; return the reward curve, the greedy eval and the
    per-step behaviour versions and mismatch figures."""
    from transformers import AutoModelForCausalLM

    from services.driver.tasks import builtin
    from services.ops.tiny_model import load_tokenizer

    torch.manual_seed(seed)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    behaviour = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    sc = step_config(correction)
    gen = torch.Generator().manual_seed(seed)
    rows = builtin("arithmetic", setup.steps * setup.batch_groups, seed=seed + 1)
    snapshots = {0: copy.deepcopy(model.state_dict())}
    curve, behav_versions, mismatch0, masked = [], [], [], []
    for v in range(setup.steps):
        bv = behaviour_version(v, eta)
        behaviour.load_state_dict(snapshots[bv])
        chunk = rows[v * setup.batch_groups:(v + 1) * setup.batch_groups]
        groups = sample(behaviour, tok, chunk, setup.group_size, bv, setup.max_tokens, setup.temperature, gen,
                        v * setup.batch_groups)
        batch = build_batch(groups, tok.pad_token_id, trainer_version=v)
        stats = train_on_batch(model, opt, batch, sc)
        snapshots[v + 1] = copy.deepcopy(model.state_dict())
        snapshots.pop(v + 1 - eta - 1, None)  # keep the last η + 1
        reward = float(batch.rewards.mean())
        curve.append(reward)
        behav_versions.append(int(batch.versions[batch.loss_mask > 0].unique().item()))
        mismatch0.append(stats.get("mismatch_kl"))
        masked.append(sum(stats.get(k, 0.0) for k in ("is_masked_fraction", "icepop_masked_fraction",
                                                      "m2po_masked_fraction")))
        if on_step:
            on_step(v, reward, stats)
    return {"eta": eta, "correction": correction, "seed": seed, "curve": curve, "behaviour_versions": behav_versions,
            "eval": greedy_eval(model.eval(), tok, eval_rows), "mismatch_kl_current": mismatch0,
            "masked_fraction": masked, "snapshots_kept": len(snapshots)}


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def table(cells: list[dict], etas: list[int], corrections: list[str]) -> tuple[str, dict]:
    """A markdown table of eval mean ± se per correction and η, the largest η within 0.02 of η = 0."""
    summary, lines = {}, ["| correction | " + " | ".join(f"η={e}" for e in etas) + " | largest η at parity |",
                          "|---" * (len(etas) + 2) + "|"]
    for c in corrections:
        row = {e: mean_se([x["eval"] for x in cells if x["eta"] == e and x["correction"] == c]) for e in etas}
        base = row[etas[0]][0]
        parity = max([e for e in etas if row[e][0] >= base - 0.02], default=None)
        summary[c] = {"eval": {str(e): row[e] for e in etas}, "parity_eta": parity}
        lines.append(f"| {c} | " + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in row.values()) + f" | {parity} |")
    return "\n".join(lines), summary


def plot(summary: dict, etas: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for c, s in summary.items():
        ms = [s["eval"][str(e)] for e in etas]
        ax.errorbar(etas, [m for m, _ in ms], yerr=[se for _, se in ms], label=c, capsize=3, marker="o")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("staleness η (versions behind, exact)")
    ax.set_ylabel("greedy accuracy, held-out problems")
    ax.set_title("staleness tolerance by correction (mean ± s.e. over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--etas", default=",".join(map(str, ETAS)))
    p.add_argument("--corrections", default=",".join(CORRECTIONS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--lr", type=float, default=None, help="default: the config's lr")
    p.add_argument("--eval-size", type=int, default=1000)
    p.add_argument("--png", default=str(ROOT / "docs" / "staleness.png"))
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    from services.driver.tasks import builtin
    from services.ops.tiny_model import make_default_model

    torch.set_num_threads(1)
    etas = [int(e) for e in args.etas.split(",")]
    corrections = args.corrections.split(",")
    for c in corrections:
        step_config(c)
    setup = Setup.from_defaults(steps=args.steps, **({"lr": args.lr} if args.lr else {}))
    eval_rows = builtin("arithmetic", args.eval_size, seed=999_999)
    print(f"setup {setup}; {len(etas)} η x {len(corrections)} corrections x {args.seeds} seeds", flush=True)
    cells, t0 = [], time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            model_dir = make_default_model(Path(tmp, f"m{seed}"), warm_steps=150, seed=seed)
            for c in corrections:
                for e in etas:
                    cell = run_cell(model_dir, e, c, seed, setup, eval_rows)
                    cells.append(cell)
                    tail = cell["curve"][-10:]
                    print(f"seed {seed} {c:>18} η={e:<3} eval {cell['eval']:.3f}  last-10 reward "
                          f"{sum(tail) / len(tail):.3f}  ({time.monotonic() - t0:.0f}s)", flush=True)
    md, summary = table(cells, etas, corrections)
    print(md)
    kl0 = [k for cell in cells for k in cell["mismatch_kl_current"] if k is not None]
    kl_line = f"mismatch KL of current-version tokens (η=0 batches, torch): max {max(kl0):.2e}" if kl0 else ""
    print(kl_line)
    plot(summary, etas, Path(args.png))
    if not args.no_record:
        from bench.record import record
        best = max(summary, key=lambda c: (summary[c]["parity_eta"] or -1))
        rows = [{"what": f"largest exact staleness η within 0.02 of η=0 greedy eval ({args.seeds} seeds, "
                         f"{args.eval_size} problems, {setup.steps} steps)",
                 "value": ", ".join(f"{c} {s['parity_eta']}" for c, s in summary.items()) + f"; best: {best}"}]
        record("staleness", rows, ["bench/staleness.py", "services/trainer"],
               extra={"summary": summary, "setup": setup.__dict__, "kl_current_max": max(kl0) if kl0 else None,
                      "cells": [{k: v for k, v in c.items()} for c in cells]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
