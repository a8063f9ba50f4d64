"""The default model of ``streamrl run``: the tiny model (tiny_model.py) plus a short supervised warm start on the
built-in task's response format, made for a recipe (task, format, mixture-of-experts family, seed, steps) and remade
when a run wants another."""

from __future__ import annotations

from pathlib import Path

from services.ops.launch.tiny_model import describe, load_tokenizer, make_tiny_model

DEFAULT_MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256, max_position_embeddings=256)
DEFAULT_WARM_STEPS = 150
# Qwen3-MoE learns the plain task faster than the others (its q/k norms and normalized top-k weights): at 150 steps
# its greedy answers were ~90% right where the dense model's were 40-70% and Mixtral's and OLMoE's 55-80% (2 seeds);
# 100 steps brings it to the same range, leaving RL as much room as on the others
MOE_WARM_STEPS = {"qwen3": 100}
# Chat episodes: the warm start teaches the chat format and the calc tool's use on half of its examples (the
# other half answers at once, as a chat model that has not learned to trust its tools would), so the policy starts
# choosing between the tool (right whenever its call copies the task: the result is then copied back) and its own
# arithmetic (often wrong), and RL's first lesson is to use the tool. Measured offline on the 2-core box (3 seeds,
# staleness 1, 64 episodes a step): a sampled reward of 0.34-0.54 at the start and about 0.9 within 30-60 steps.
# With every example calling the tool the model was nearly right from the start, or (fewer steps) copied the tool's
# result wrongly with no doubt, so every group's rewards were equal and there was nothing to learn from; with 40%
# calling it, the copy was learned too slowly.
AGENT_WARM_STEPS = 400
AGENT_TOOL_SHARE = 0.5
# agent runs: the chat template's tools prompt alone is ~330 characters (102 tokens with the chat words), and an
# episode of four calls carries every turn before its last
AGENT_CONTEXT = 1024
# what the default model was made for; a run wanting another remakes it
RECIPE_FILE = "streamrl-default.json"
# The calculator tool of ``examples/calc.py`` (a test keeps the two equal): the agent-format warm start
# renders it into every system turn, as the gateway will.
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate + - * on integers",
        "parameters": {"type": "object", "properties": {"e": {"type": "string"}}, "required": ["e"]},
    },
}


def sft_examples(rows: list[dict], tokenizer, tools: bool = False) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per task row: prompt, then the reference response (``services.driver.tasks.reference``)
    and <eos>. Labels are -100 on the prompt and on tool results (the worker inserts those, the model
    never writes them), so the warm start teaches exactly what the policy generates."""
    from services.driver.tasks import reference

    out = []
    for row in rows:
        ids = tokenizer.encode(row["prompt"], add_special_tokens=False)
        labels = [-100] * len(ids)
        for text, learn in reference(row, tools=tools):
            part = tokenizer.encode(text, add_special_tokens=False)
            ids += part
            labels += part if learn else [-100] * len(part)
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
        out.append((ids, labels))
    return out


def agent_sft_examples(
    rows: list[dict], tokenizer, tool_share: float = 1.0, seed: int = 0
) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per task row, laid out exactly as the gateway lays out ``examples/calc.py``'s
    episode: the chat-template prompt (system turn with the calc tool, the user's task), the model's
    ``<tool_call>`` on the task's expression, the tool's result (masked: the agent writes it), the answer.
    A row answers at once instead, without the tool, with probability 1 − ``tool_share`` (drawn with ``seed``).
    The ids come from the gateway's own renderer, so the warm start sees what the policy will see."""
    import json
    import random

    from services.gateway.chat import Renderer

    r, tools = Renderer(tokenizer), [CALC_TOOL]
    rng = random.Random(seed)
    out = []
    for row in rows:
        prompt = r.full([{"role": "user", "content": row["prompt"]}], tools)
        if rng.random() >= tool_share:
            answer = r.encode(row["answer"]) + [r.end_id]
            out.append((prompt + answer, [-100] * len(prompt) + answer))
            continue
        expr = row["prompt"].removesuffix("=")
        call = f"<tool_call>{json.dumps({'name': 'calc', 'arguments': {'e': expr}})}</tool_call>"
        first = r.encode(call) + [r.end_id]
        bridge = r.bridge(True, [{"role": "tool", "tool_call_id": "call_0_0", "content": row["answer"]}], tools)
        second = r.encode(row["answer"]) + [r.end_id]
        ids = prompt + first + bridge + second
        labels = [-100] * len(prompt) + first + [-100] * len(bridge) + second
        out.append((ids, labels))
    return out


def warm_start(
    model_dir: str | Path,
    examples: list[tuple[list[int], list[int]]],
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    log=None,
    threads: int = 1,
) -> float:
    """Supervised steps on ``examples`` (sampled with replacement); saves the model in place.
    Returns the last step's loss. ``threads``: torch threads meanwhile (0: torch's default)."""
    import random

    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    before = torch.get_num_threads()
    # short rows on a tiny model: one thread is as fast, and 10x faster on a busy box than N fighting
    torch.set_num_threads(threads or before)
    try:
        return _warm_start(model_dir, examples, steps, batch_size, lr, rng, log)
    finally:
        torch.set_num_threads(before)


def _warm_start(model_dir, examples, steps, batch_size, lr, rng, log) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
    pad = model.config.pad_token_id or 0
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log and (step + 1) % 50 == 0:
            log(f"warm start step {step + 1}/{steps}: loss {float(loss.detach()):.3f}")
    model.eval().save_pretrained(str(model_dir))
    return float(loss.detach())


def greedy_accuracy(model_dir: str | Path, rows: list[dict], max_tokens: int = 16) -> float:
    """Share of ``rows`` whose greedy single-turn answer the default reward accepts (no tools)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.rollout.jobs.rewards import arithmetic

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    right = 0
    with torch.inference_mode():
        for row in rows:
            ids = torch.tensor([tok.encode(row["prompt"], add_special_tokens=False)])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            right += arithmetic(text, row)[0] == 1.0
    return right / max(len(rows), 1)


def make_default_model(
    out_dir: str | Path,
    dataset: str = "arithmetic",
    tools: bool = False,
    warm_steps: int = 100,
    seed: int = 0,
    log=None,
    agent: bool = False,
    moe: str = "",
) -> str:
    """The default model of ``streamrl run``: :func:`make_tiny_model` plus a short supervised warm
    start (``warm_steps`` steps of 32) on the built-in task's response format. Brief on purpose: the
    model writes answers in the right shape but gets most of them wrong, so the reward has room to
    rise, and it is RL that lifts it. ``tools`` warm-starts on the worker's calculator-tool format
    instead; ``agent`` on ``examples/calc.py``'s chat episodes (native tool calls through the chat
    template), with a 1,024-token context. ``moe``: the model is that family's mixture of experts
    (:func:`model_config`)."""
    from services.driver.tasks import builtin

    shape = dict(DEFAULT_MODEL, max_position_embeddings=AGENT_CONTEXT) if agent else DEFAULT_MODEL
    make_tiny_model(out_dir, **shape, seed=seed, moe=moe, chat_words=agent)
    if warm_steps > 0:
        # another draw than the run's prompts (seeded by cfg.seed)
        rows = builtin(dataset, 4096, seed=seed + 12345)
        tok = load_tokenizer(out_dir)
        examples = (
            agent_sft_examples(rows, tok, tool_share=AGENT_TOOL_SHARE, seed=seed)
            if agent
            else sft_examples(rows, tok, tools=tools)
        )
        warm_start(out_dir, examples, warm_steps, seed=seed, log=log, threads=0 if agent else 1)
    return str(out_dir)


def default_recipe(cfg, warm_steps: int | None = None) -> dict:
    """What ``cfg`` wants the default model made for: its task, its format (plain text, the worker's
    calc tool, or chat episodes through the gateway), its seed and warm start, and for a mixture of experts
    (``model_moe``) its family under "moe" (no entry for the dense model: markers made before there were MoE
    variants stay equal)."""
    from services.driver.tasks import BUILTIN

    tools = "calc" in {t.strip() for t in cfg.tools.split(",")}
    steps = AGENT_WARM_STEPS if cfg.agent else MOE_WARM_STEPS.get(cfg.model_moe, DEFAULT_WARM_STEPS)
    return {
        "dataset": cfg.dataset if cfg.dataset in BUILTIN else "arithmetic",
        "format": "agent" if cfg.agent else "tools" if tools else "plain",
        "seed": cfg.seed,
        "warm_steps": warm_steps if warm_steps is not None else steps,
        **({"moe": cfg.model_moe} if cfg.model_moe else {}),
        # agent models made before the chat words and the tool share are remade
        **({"tool_share": AGENT_TOOL_SHARE} if cfg.agent else {}),
    }


def ensure_default_model(cfg, warm_steps: int | None = None, force: bool = False) -> bool:
    """Create the default model at ``cfg.model_dir`` unless one made for the same recipe
    (:func:`default_recipe`) is there, or ``force``: warm-started on ``cfg.dataset`` when it is a
    built-in task (else on arithmetic), on the calculator-tool format when ``cfg.tools`` names ``calc``,
    on chat episodes with the calc tool when ``cfg.agent`` is set; a mixture of experts when ``cfg.model_moe``
    names a family. A default model made for another
    recipe is remade (it is the project's own, made in seconds; say so). Returns whether it made one."""
    import json
    import shutil
    import sys
    import time

    recipe = default_recipe(cfg, warm_steps)
    marker = Path(cfg.model_dir, RECIPE_FILE)
    if Path(cfg.model_dir, "config.json").exists() and not force:
        try:
            made = json.loads(marker.read_text())
        except (OSError, ValueError):
            made = None
        if (
            made == recipe
            or warm_steps is None
            and isinstance(made, dict)
            and {**made, "warm_steps": None} == {**recipe, "warm_steps": None}
        ):
            # the same recipe (a run takes whatever warm start make-model was given)
            return False
        print(
            f"streamrl: the default model at {cfg.model_dir} was made for {made}; this run wants {recipe}: remaking it",
            file=sys.stderr,
            flush=True,
        )
        shutil.rmtree(cfg.model_dir)
    fmt = {
        "agent": " as chat episodes with the calc tool (1,024-token context)",
        "tools": " with the calc tool",
        "plain": "",
    }[recipe["format"]]
    print(
        f"streamrl: creating the default model at {cfg.model_dir}: random-init "
        f"{describe(recipe.get('moe', ''), DEFAULT_MODEL['num_layers'])} + {recipe['warm_steps']} supervised "
        f"warm-start steps on {recipe['dataset']}{fmt}",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.monotonic()
    make_default_model(
        cfg.model_dir,
        dataset=recipe["dataset"],
        tools=recipe["format"] == "tools",
        warm_steps=recipe["warm_steps"],
        seed=cfg.seed,
        agent=recipe["format"] == "agent",
        moe=recipe.get("moe", ""),
        log=lambda line: print(f"streamrl: {line}", file=sys.stderr, flush=True),
    )
    marker.write_text(json.dumps(recipe, sort_keys=True) + "\n")
    print(f"streamrl: model ready in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    return True


def ensure_model(cfg) -> str:
    """The model folder of ``cfg.model_dir``: the default tiny model is created when missing, and remade when it
    was made for another recipe (an agent run after a plain one needs the chat format and a 1,024-token context:
    on the plain model every agent call was refused as too long); anything else must resolve (a folder or a
    cached hub id), else ModelNotFound names the key and what was tried."""
    from shared.runtime.models import is_default, resolve_model

    if is_default(cfg.model_dir):
        ensure_default_model(cfg)
    return resolve_model(cfg.model_dir)
