"""What the model is given: a prompt group's prompt as token ids, and the token ids that end a response."""

from __future__ import annotations

from shared.protocol.prompts import PromptGroup


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Token ids that end generation."""
    return tuple(t for t in (tokenizer.eos_token_id,) if t is not None)


def prompt_ids(tokenizer, group: PromptGroup) -> list[int]:
    """The group's prompt as token ids: given, or its text tokenized."""
    if group.prompt_ids is not None:
        return list(group.prompt_ids)
    return tokenizer.encode(group.prompt, add_special_tokens=False)
