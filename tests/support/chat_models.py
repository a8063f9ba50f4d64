"""A tiny chat model for gateway tests: the character-level tiny Llama plus ChatML
special tokens and a ChatML chat template with Hermes-style tools, optionally
overfit on scripted conversations so that greedy decoding writes exactly the
assistant turns (tool calls included) a test needs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.ops.launch.tiny_model import make_tiny_model
from tests.support.models import fit_rows

CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\nTools: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "evaluate",
        "parameters": {"type": "object", "properties": {"e": {"type": "string"}}},
    },
}


def make_chat_model(out_dir: str | Path, max_len: int = 1024, hidden_size: int = 64, seed: int = 1) -> str:
    make_tiny_model(str(out_dir), hidden_size=hidden_size, max_position_embeddings=max_len, seed=seed)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TOOLS
    model = AutoModelForCausalLM.from_pretrained(str(out_dir))
    model.resize_token_embeddings(len(tok))
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return str(out_dir)


def overfit_conversations(
    model_dir: str | Path, conversations: list[tuple[list[dict], list]], steps: int = 400, lr: float = 3e-3
) -> str:
    """Train on whole rendered conversations (every token a label) until greedy decoding reproduces them."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    from services.gateway.chat import template_messages

    rows = [
        tok.encode(
            tok.apply_chat_template(template_messages(msgs), tools=tools, tokenize=False), add_special_tokens=False
        )
        for msgs, tools in conversations
    ]
    return fit_rows(model_dir, model, tok.pad_token_id, [(row, 0) for row in rows], steps, lr)


def scripted_chat_model(out_dir: str | Path, conversations: list[tuple[list[dict], list]], steps: int = 250) -> str:
    """``make_chat_model`` + ``overfit_conversations``, cached on disk by what it is built from (the box is slow:
    training takes a minute, copying the cached one a moment)."""
    import hashlib
    import json
    import os
    import shutil

    key = hashlib.sha256(
        json.dumps([CHATML_TOOLS, conversations, steps, torch.__version__], sort_keys=True).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("TESTS_CACHE_DIR_STREAMRL", Path.home() / ".cache" / "streamrl-tests")) / f"chat-{key}"
    if not (cache / "model.safetensors").exists():
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        overfit_conversations(make_chat_model(tmp, max_len=512), conversations, steps=steps)
        tmp.rename(cache) if not cache.exists() else shutil.rmtree(tmp)
    shutil.copytree(cache, out_dir, dirs_exist_ok=True)
    return str(out_dir)


def tool_call_message(expr: str, call_id: str = "x") -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "calc", "arguments": f'{{"e": "{expr}"}}'}}
        ],
    }


def calc_conversation(a: int, b: int) -> list[dict]:
    """user asks, assistant calls calc twice (the second checks), then answers: three assistant turns."""
    return [
        {"role": "user", "content": f"{a}+{b}?"},
        tool_call_message(f"{a}+{b}"),
        {"role": "tool", "content": str(a + b)},
        tool_call_message(f"{a + b}"),
        {"role": "tool", "content": str(a + b)},
        {"role": "assistant", "content": f"answer: {a + b}"},
    ]
