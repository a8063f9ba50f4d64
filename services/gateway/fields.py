"""The request fields the gateway reads no further than to say it changes nothing, or to refuse it: one table,
so that nothing a framework sends that would change the answer is silently dropped.

``NOOP``: fields that change nothing the gateway promises (bookkeeping for OpenAI's platform, or latency hints),
accepted whatever their value. ``REFUSED``: fields that would change the answer, accepted only at the value that
changes nothing (a zero penalty, an empty bias); any other value is a 400 naming the field. Fields the gateway
honours (sampling, tools, tool_choice, parallel_tool_calls, response_format, stop, seed, n, stream, logprobs) are
read in ``schema.py`` and ``core.py``. A field in none of these is let through, as OpenAI clients send many.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from services.gateway.errors import GatewayError

NOOP = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    # predicted outputs speed a reply up; OpenAI's answer is the same with or without one
    "prediction",
)


def _zero(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


def _one(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1)


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == []


def _false(v: Any) -> bool:
    return v is None or v is False


# field -> (does this value change nothing?, what the gateway can take, why)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (_zero, "0 (the policy samples from its own distribution: no penalties)"),
    "frequency_penalty": (_zero, "0 (the policy samples from its own distribution: no penalties)"),
    "repetition_penalty": (_one, "1 (the policy samples from its own distribution: no penalties)"),
    "logit_bias": (_empty, "an empty map (a bias would change the sampling distribution the trainer corrects with)"),
    "top_logprobs": (_zero, "0 (the episode stream keeps the sampled token's log-prob only)"),
    "modalities": (lambda v: v is None or v == ["text"], '["text"] (the policy writes text)'),
    "audio": (lambda v: v is None, "null (the policy writes text)"),
    "reasoning_effort": (lambda v: v is None, "null (the policy's reasoning is not configurable)"),
    "verbosity": (lambda v: v is None, "null (the policy's length is max_tokens)"),
    "web_search_options": (lambda v: v is None, "null (no built-in tools)"),
    "functions": (_empty, "nothing (the legacy form; send tools)"),
    "function_call": (lambda v: v is None, "nothing (the legacy form; send tool_choice)"),
    # vLLM's extensions: the server's sampling settings hold for every call of a run
    "top_k": (lambda v: v is None, "nothing (the server's top_k holds for every call)"),
    "min_p": (_zero, "0 (the server's sampling holds for every call)"),
    "min_tokens": (_zero, "0 (the policy stops where it stops)"),
    "ignore_eos": (_false, "false (the policy stops where it stops)"),
    "best_of": (_one, "1 (one sample per choice; ask for n)"),
    "use_beam_search": (_false, "false (the policy samples)"),
    "guided_json": (lambda v: v is None, "nothing (no constrained decoding; response_format is a hint)"),
    "guided_regex": (lambda v: v is None, "nothing (no constrained decoding)"),
    "guided_choice": (lambda v: v is None, "nothing (no constrained decoding)"),
    "guided_grammar": (lambda v: v is None, "nothing (no constrained decoding)"),
    "structured_outputs": (lambda v: v is None, "nothing (no constrained decoding; response_format is a hint)"),
    "include_stop_str_in_output": (_false, "false (the answer is cut before a stop string, as OpenAI's is)"),
    "skip_special_tokens": (lambda v: v is None or v is True, "true (answers are decoded without special tokens)"),
    # the legacy completions API's
    "echo": (_false, "false (the answer is the completion)"),
    "suffix": (lambda v: v is None, "nothing (no insertion)"),
}

# stream_options keys: include_usage is honoured; these change nothing we promise
STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def check(body: dict) -> None:
    """GatewayError 400 naming the first field of ``body`` at a value the gateway cannot honour."""
    for name, (fine, expected) in REFUSED.items():
        if name in body and not fine(body[name]):
            raise GatewayError(
                400,
                f"{name}: cannot be honoured; expected {expected}, got {json.dumps(body[name], default=str)[:80]}",
                name,
                "unsupported_value",
            )
    options = body.get("stream_options")
    if isinstance(options, dict):
        for key in options:
            if key not in STREAM_OPTIONS:
                raise GatewayError(
                    400,
                    f"stream_options.{key}: unknown; expected only {', '.join(STREAM_OPTIONS)}",
                    f"stream_options.{key}",
                    "unsupported_value",
                )
