"""What the model is given: a prompt group's prompt as token ids, and the token ids that end a response.
The rules (chat template, BOS, the stop-id union) live in ``shared.runtime.prompt_format``."""

from __future__ import annotations

from shared.protocol.streams.prompts import PromptGroup
from shared.runtime.prompt_format import encode_prompt
from shared.runtime.prompt_format import stop_token_ids as _stop_ids


def stop_token_ids(tokenizer, model_dir: str = "", stop: str = "") -> tuple[int, ...]:
    """Token ids that end generation: eos ∪ generation_config eos ∪ the ``stop`` config key."""
    return tuple(_stop_ids(tokenizer, model_dir, stop))


def prompt_ids(tokenizer, group: PromptGroup) -> list[int]:
    """The group's prompt as token ids: given, or its text (or chat messages) encoded."""
    if group.prompt_ids is not None:
        return list(group.prompt_ids)
    return encode_prompt(tokenizer, group.prompt)
