"""One cell of the agent staleness benchmark (bench/learning/staleness_agent.py): ``examples/calc.py``'s episodes run in
process, with the gateway's own chat renderer and tool-call parser and the agent's own tool and reward, sampled by
version v − η and trained by the trainer's own step. No Redis, no gateway server, no HTTP.

An episode, as ``examples/calc.py`` plays it through the gateway: the chat-template prompt (the system turn
listing the calc tool, the user's task ``3+4+5+6=``), the assistant's first turn; if it calls the tool, the tool
turn (``examples.calc.calc`` on the call's ``e``: tokens the agent wrote, mask 0) and the assistant's second turn.
Reward: the last number of the final assistant message equals the answer (calc.py's rule). One difference from
calc.py: at most two LLM calls (calc.py allows four; a second turn that calls the tool again ends the episode
with its content, which scores 0)."""

from __future__ import annotations

import copy
import json
import re

import torch

from bench.learning.staleness_cell import Setup, behaviour_version, by_width, draw, start_cell
from services.trainer.batch import build_batch
from services.trainer.step import train_on_batch
from shared.protocol.episode.fold import Episode
from shared.protocol.episode.logprobs import token_logprobs

# per LLM call, as examples/calc.py asks
MAX_TOKENS = 96


# the default agent model's warm start (services/ops/launch/tiny_model.py: AGENT_WARM_STEPS) is one stage
WARM_STAGE = 400


def make_agent_model(
    out_dir, pool: list[dict], warm_steps: int, seed: int, start: tuple[str, int] | None = None
) -> str:
    """The default agent model (services/ops/launch/tiny_model.py: the default shape with a 1,024-token context,
    warm-started on calc.py's chat episodes), its warm start drawn from ``pool`` only, in stages of 400 steps:
    stage k draws its 4,096 examples with seed + 12345 + k and goes on from the last stage's weights with a fresh
    optimizer (stage 0 is the default model's recipe). ``start`` = (a model made so, its warm steps): copied and
    continued, the same as made from scratch."""
    import shutil

    from services.ops.launch.default_model import AGENT_CONTEXT, DEFAULT_MODEL, agent_sft_examples, warm_start
    from services.ops.launch.tiny_model import load_tokenizer, make_tiny_model

    done = 0
    if start:
        shutil.copytree(start[0], out_dir, dirs_exist_ok=True)
        done = start[1]
    else:
        make_tiny_model(out_dir, **dict(DEFAULT_MODEL, max_position_embeddings=AGENT_CONTEXT), seed=seed)
    tok = load_tokenizer(out_dir)
    while done < warm_steps:
        k, n = done // WARM_STAGE, min(WARM_STAGE, warm_steps - done)
        warm_start(out_dir, agent_sft_examples(draw(pool, 4096, seed + 12345 + k), tok), n, seed=seed + k)
        done += n
    return str(out_dir)


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    stop_ids: list[int],
    temperature: float,
    gen: torch.Generator | None,
    max_tokens: int = MAX_TOKENS,
) -> list[list[int]]:
    """Each prompt's completion (its stop token included when it stopped), sampled at ``temperature`` from the
    full softmax (greedy at 0), with a KV cache; prompts of one length at a time (no padding)."""
    import inspect

    out: list[list[int]] = [[] for _ in prompts]
    stop = torch.tensor(stop_ids)
    # the KV cache's name, in and out (services/rollout/engine/model_runner.py): `cache` from transformers 5.24
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for _, idx in by_width(prompts).items():
        res = model(input_ids=torch.tensor([prompts[i] for i in idx]), use_cache=True)
        done = torch.zeros(len(idx), dtype=torch.bool)
        for _ in range(max_tokens):
            logits = res.logits[:, -1].float()
            if temperature > 0:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(1)
            else:
                nxt = logits.argmax(-1)
            for j in (~done).nonzero().flatten().tolist():
                out[idx[j]].append(int(nxt[j]))
            done |= torch.isin(nxt, stop)
            if done.all():
                break
            res = model(input_ids=nxt[:, None], use_cache=True, **{name: getattr(res, name)})
    return out


def _expr(arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return ""
    return str(args.get("e", "")) if isinstance(args, dict) else ""


def calc_reward(content: str | None, answer) -> float:
    """examples/calc.py's reward: the last number of the final assistant message equals the answer."""
    numbers = re.findall(r"-?\d+", content or "")
    return float(bool(numbers) and numbers[-1] == str(answer))


def after_call(r, ids: list[int], index: int) -> tuple[list[int] | None, str | None]:
    """What follows the LLM call ``index`` whose completion is ``ids``, as calc.py and the gateway play it: (the
    tool turn's tokens, through the next assistant turn's opening, None) when it calls the tool (each call's ``e``
    through ``examples.calc.calc``), else (None, the final message's content)."""
    from examples.calc import TOOLS, calc

    message, _ = r.assistant(ids, index)
    if not message.get("tool_calls"):
        return None, message.get("content")
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": calc(_expr(c["function"]["arguments"]))}
        for c in message["tool_calls"]
    ]
    return r.bridge(bool(ids) and ids[-1] in r.stop_ids, results, TOOLS) or [], None


@torch.no_grad()
def play(
    model,
    tok,
    rows: list[dict],
    n: int,
    version: int,
    temperature: float,
    gen,
    group_offset: int = 0,
    episodes: bool = True,
):
    """``n`` episodes per row under ``model``; the groups of Episodes (behaviour log-probs recorded under
    ``model``, the rollout engines' definition), or with ``episodes=False`` only the rewards (the evaluation)."""
    from examples.calc import TOOLS
    from services.gateway.chat import Renderer

    r = Renderer(tok)
    plays = [(g, i) for g in range(len(rows)) for i in range(n)]
    prompts = [r.full([{"role": "user", "content": rows[g]["prompt"]}], TOOLS) for g, _ in plays]
    first = generate(model, prompts, r.stop_ids, temperature, gen)
    bridges, seconds, finals = {}, {}, {}
    for k, ids in enumerate(first):
        bridge, finals[k] = after_call(r, ids, 0)
        if bridge is not None:
            bridges[k] = bridge
    keys = list(bridges)
    for k, ids in zip(
        keys, generate(model, [prompts[k] + first[k] + bridges[k] for k in keys], r.stop_ids, temperature, gen)
    ):
        seconds[k] = ids
        message, _ = r.assistant(ids, 1)
        # a third call: not played
        finals[k] = None if message.get("tool_calls") else message.get("content")
    rewards = [calc_reward(finals[k], rows[g]["answer"]) for k, (g, _) in enumerate(plays)]
    if not episodes:
        return rewards
    responses = [first[k] + bridges.get(k, []) + seconds.get(k, []) for k in range(len(plays))]
    masks = [
        [1] * len(first[k]) + [0] * len(bridges.get(k, [])) + [1] * len(seconds.get(k, [])) for k in range(len(plays))
    ]
    full = [p + t for p, t in zip(prompts, responses)]
    logps: list[list[float]] = [[] for _ in plays]
    for _, idx in by_width(full).items():
        seq = torch.tensor([full[k] for k in idx])
        lp = token_logprobs(model(input_ids=seq).logits[:, :-1].float(), seq[:, 1:], temperature)
        for j, k in enumerate(idx):
            logps[k] = lp[j, len(prompts[k]) - 1 :].tolist()
    groups: list[list[Episode]] = [[] for _ in rows]
    for k, (g, i) in enumerate(plays):
        last = responses[k][-1] if responses[k] else None
        groups[g].append(
            Episode(
                f"e{group_offset + g}-{i}",
                f"g{group_offset + g}",
                i,
                prompts[k],
                {"temperature": temperature},
                rows[g],
                tokens=responses[k],
                logprobs=[lp if m else 0.0 for lp, m in zip(logps[k], masks[k])],
                versions=[version if m else -1 for m in masks[k]],
                mask=masks[k],
                status="finished",
                finish_reason="stop" if last in r.stop_ids else "length",
                reward=rewards[k],
            )
        )
    return groups


def run_agent_cell(
    model_dir: str, eta: int, correction: str, seed: int, setup: Setup, eval_rows: list[dict], pool: list[dict]
) -> dict:
    """bench/learning/staleness_cell.py's ``run_cell`` on the agent's episodes: ``setup.steps`` versions at staleness
    exactly η, the greedy evaluation (calc.py's reward on held-out problems) every ``setup.eval_every`` versions
    over the last ``setup.eval_last`` of them."""
    tok, model, behaviour, opt, sc, gen, rows, snapshots = start_cell(model_dir, correction, seed, setup, pool)
    curve, behav_versions, mismatch0, masked, eval_curve, tool_calls = [], [], [], [], [], []
    for v in range(setup.steps):
        bv = behaviour_version(v, eta)
        behaviour.load_state_dict(snapshots[bv])
        chunk = rows[v * setup.batch_groups : (v + 1) * setup.batch_groups]
        groups = play(behaviour, tok, chunk, setup.group_size, bv, setup.temperature, gen, v * setup.batch_groups)
        batch = build_batch(groups, tok.pad_token_id, trainer_version=v)
        stats = train_on_batch(model, opt, batch, sc)
        snapshots[v + 1] = copy.deepcopy(model.state_dict())
        # keep the last η + 1
        snapshots.pop(v + 1 - eta - 1, None)
        curve.append(float(batch.rewards.mean()))
        tool_calls.append(sum(0 in ep.mask for g in groups for ep in g) / (len(groups) * setup.group_size))
        behav_versions.append(int(batch.versions[batch.loss_mask > 0].unique().item()))
        mismatch0.append(stats.get("mismatch_kl"))
        masked.append(
            sum(stats.get(k, 0.0) for k in ("is_masked_fraction", "icepop_masked_fraction", "m2po_masked_fraction"))
        )
        if (v + 1) % setup.eval_every == 0 and v + 1 > setup.steps - setup.eval_every * setup.eval_last:
            got = play(model.eval(), tok, eval_rows, 1, v + 1, 0.0, None, episodes=False)
            eval_curve.append((v + 1, sum(got) / len(got)))
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
        "tool_call_share": tool_calls,
        "snapshots_kept": len(snapshots),
    }
