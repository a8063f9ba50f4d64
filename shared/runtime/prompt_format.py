"""From a prompt to the token ids the model sees, and where its generation stops.

A prompt is text, or chat messages (a list of ``{"role", "content"}`` maps, OpenAI style). Messages go through
the tokenizer's chat template with ``add_generation_prompt`` (the template writes BOS itself when the model
wants one, so nothing is added on top). Text is encoded the way the tokenizer encodes by default, which adds
BOS for a model that expects one; a BOS the text already starts with is not doubled.

Stop ids are the union of the tokenizer's EOS, the model's ``generation_config`` EOS ids (instruct models end
a turn with e.g. ``<|im_end|>`` or ``<|eot_id|>``) and the ``stop`` config key."""

from __future__ import annotations

import json
from typing import Any


class PromptError(ValueError):
    pass


def is_messages(prompt: Any) -> bool:
    return isinstance(prompt, list)


def check_messages(messages: Any, where: str) -> list[dict]:
    """``messages`` as a list of maps with a str ``role`` (content: str, or absent/None with tool calls)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where}: expected a non-empty list of chat messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError(f"{where}: message {i}: expected a map with a 'role' string, got {m!r:.80}")
        if not isinstance(m.get("content"), (str, type(None), list)):
            raise PromptError(f"{where}: message {i}: 'content' must be a string, got {type(m['content']).__name__}")
    return messages


def prompt_key(prompt: str | list) -> str:
    """A stable text for hashing and de-duplicating a prompt of either kind."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def encode_prompt(tokenizer, prompt: str | list, tools: list | None = None) -> list[int]:
    if is_messages(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(
                "a chat-message prompt needs a tokenizer with a chat template; this one has none "
                "(give the model folder a chat_template, or use text prompts)"
            )
        out = tokenizer.apply_chat_template(
            prompt, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(i) for i in (out["input_ids"] if isinstance(out, dict) else out)]
    ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is not None and ids[:2] == [bos, bos]:
        # the text already started with BOS
        ids = ids[1:]
    if eos is not None and ids and ids[-1] == eos and not prompt.endswith(tokenizer.eos_token or "\0"):
        # a tokenizer that appends EOS would end the prompt before the answer
        ids = ids[:-1]
    return ids


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def parse_stop(tokenizer, stop: str) -> list[int]:
    """The ``stop`` config key: comma-separated token ids and/or strings that are one token each."""
    out = []
    for item in (s.strip() for s in stop.split(",")):
        if not item:
            continue
        if item.isdigit():
            out.append(int(item))
            continue
        tid = tokenizer.convert_tokens_to_ids(item)
        if tid is None or tid == tokenizer.unk_token_id:
            ids = tokenizer.encode(item, add_special_tokens=False)
            if len(ids) != 1:
                raise PromptError(
                    f"config key 'stop': {item!r} is {len(ids)} tokens for this tokenizer; a stop "
                    f"string must be exactly one token (or give token ids)"
                )
            tid = ids[0]
        out.append(int(tid))
    return out


def stop_token_ids(tokenizer, model_dir: str | None = None, stop: str = "") -> tuple[int, ...]:
    """EOS of the tokenizer ∪ EOS of the model's generation config ∪ ``stop``, in that order, without repeats."""
    ids = _as_list(tokenizer.eos_token_id)
    if model_dir:
        from transformers import GenerationConfig

        from shared.runtime.models import resolve_model

        try:
            ids += _as_list(GenerationConfig.from_pretrained(resolve_model(model_dir)).eos_token_id)
        except (OSError, ValueError):
            # no model folder or no generation_config.json: the tokenizer's EOS it is
            pass
    ids += parse_stop(tokenizer, stop)
    return tuple(dict.fromkeys(ids))
