"""A tiny random-init Llama (or a mixture of experts of the same size class: Qwen3-MoE, Mixtral, OLMoE) with a
character-level tokenizer, built locally (no model hub), for tests and smoke runs."""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
# ChatML turn markers: ids 101 and 102, after the characters
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c"]
# ChatML with tools (Qwen2.5 style): a system turn lists the tools as JSON, an assistant's tool calls are written
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, a tool's result comes back in a `tool` turn.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call these tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """Character-level tokenizer: <pad>=0, <bos>=1, <eos>=2, then printable ASCII, then the ChatML
    markers <|im_start|>=101, <|im_end|>=102 (special tokens) and a ChatML chat template with tool support.
    Characters outside the vocabulary encode as "?"."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        clean_up_tokenization_spaces=False,
    )
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# the mixture-of-experts variants: model_moe's value -> the family's name in messages
MOE_NAMES = {"qwen3": "Qwen3-MoE", "mixtral": "Mixtral", "olmoe": "OLMoE"}
MOE_EXPERTS = 8
MOE_TOP_K = 2


def model_config(
    tok,
    moe: str = "",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    experts: int = MOE_EXPERTS,
    top_k: int = MOE_TOP_K,
):
    """The transformers config of a tiny model for tokenizer ``tok``: a Llama (``moe`` empty), else every layer's MLP
    a mixture of ``experts`` experts of which a token takes ``top_k``, each expert ``intermediate_size // top_k``
    wide so that a token's active parameters are the dense model's."""
    from transformers import LlamaConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    if moe and moe not in MOE_NAMES:
        raise ValueError(f"moe: expected one of {', '.join(MOE_NAMES)} or '' (dense), got {moe!r}")
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    expert = intermediate_size // top_k
    # the router's load-balancing loss stays off (output_router_logits false, each family's default): the warm
    # start and the trainer see the task's loss alone
    if moe == "qwen3":
        return Qwen3MoeConfig(
            head_dim=hidden_size // num_heads,
            # the MLP of a dense layer (mlp_only_layers): none here
            intermediate_size=intermediate_size,
            moe_intermediate_size=expert,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
            output_router_logits=False,
            **common,
        )
    if moe == "mixtral":
        return MixtralConfig(
            head_dim=hidden_size // num_heads,
            intermediate_size=expert,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            output_router_logits=False,
            **common,
        )
    if moe == "olmoe":
        return OlmoeConfig(
            intermediate_size=expert,
            num_experts=experts,
            num_experts_per_tok=top_k,
            output_router_logits=False,
            **common,
        )
    return LlamaConfig(intermediate_size=intermediate_size, **common)


def describe(moe: str = "", num_layers: int = 2) -> str:
    """The model in words: "2-layer Llama", "2-layer Qwen3-MoE (8 experts, top-2)"."""
    if not moe:
        return f"{num_layers}-layer Llama"
    return f"{num_layers}-layer {MOE_NAMES[moe]} ({MOE_EXPERTS} experts, top-{MOE_TOP_K})"


def make_tiny_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
    moe: str = "",
) -> str:
    """Save a random-init causal LM (safetensors) and its tokenizer into ``out_dir``: a LlamaForCausalLM, or with
    ``moe`` (qwen3 | mixtral | olmoe) that family's mixture of experts (:func:`model_config`)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = build_tokenizer()
    config = model_config(
        tok,
        moe,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # generation ends at <eos> (plain-text prompts) or at the end of the assistant's turn (chat prompts)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")],
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return str(out_dir)


# --- the default model: random init + a short supervised warm start on the task ---------------------------

DEFAULT_MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256, max_position_embeddings=256)
DEFAULT_WARM_STEPS = 150
# Qwen3-MoE learns the plain task faster than the others (its q/k norms and normalized top-k weights): at 150 steps
# its greedy answers were ~90% right where the dense model's were 40-70% and Mixtral's and OLMoE's 55-80% (2 seeds);
# 100 steps brings it to the same range, leaving RL as much room as on the others
MOE_WARM_STEPS = {"qwen3": 100}
# Chat episodes take longer to learn: the model must copy the task's expression into its tool call across a
# ~330-token prompt. Measured on the 2-core box (seed 0): 0% exact tool calls at 200 steps, ~36% at 400, 100% at
# 600; 400 leaves RL room to lift it (and takes ~2.5 min, once).
AGENT_WARM_STEPS = 400
# agent runs: the chat template's tools prompt alone is ~300 characters (= tokens)
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


def agent_sft_examples(rows: list[dict], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per task row, laid out exactly as the gateway lays out ``examples/calc.py``'s
    episode: the chat-template prompt (system turn with the calc tool, the user's task), the model's
    ``<tool_call>`` on the task's expression, the tool's result (masked: the agent writes it), the answer.
    The ids come from the gateway's own renderer, so the warm start sees what the policy will see."""
    import json

    from services.gateway.chat import Renderer

    r, tools = Renderer(tokenizer), [CALC_TOOL]
    out = []
    for row in rows:
        expr = row["prompt"].removesuffix("=")
        call = f"<tool_call>{json.dumps({'name': 'calc', 'arguments': {'e': expr}})}</tool_call>"
        prompt = r.full([{"role": "user", "content": row["prompt"]}], tools)
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
    make_tiny_model(out_dir, **shape, seed=seed, moe=moe)
    if warm_steps > 0:
        # another draw than the run's prompts (seeded by cfg.seed)
        rows = builtin(dataset, 4096, seed=seed + 12345)
        tok = load_tokenizer(out_dir)
        examples = agent_sft_examples(rows, tok) if agent else sft_examples(rows, tok, tools=tools)
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
