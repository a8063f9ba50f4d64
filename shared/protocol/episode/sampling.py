"""The one rule on sampling parameters in entries (a prompt group's ``sampling`` overrides, a gateway call's
``sampling``): known keys only, each of its type and in its range, every number finite. A codec calls ``check``
on decode, so a poison entry (``"temperature": "hot"``, NaN) is an ``EventError`` naming the field, dead-lettered
and acknowledged, never a crash of the worker that reads it."""

from __future__ import annotations

import math
import zlib

from shared.protocol.episode.errors import EventError

MAX_TOKENS = 1 << 20
# stop strings of one call: how many, and how long each may be (characters)
MAX_STOPS, MAX_STOP_CHARS = 4, 256
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


def stable_seed(*parts) -> int:
    """A sampling seed from its parts, stable across processes and runs (unlike hash())."""
    return zlib.crc32(":".join(map(str, parts)).encode()) & 0x7FFFFFFF


def episode_seed(base: int, group_id: str, index: int) -> int:
    """The seed an episode samples with unless its group says otherwise (the run's ``seed`` is ``base``); a
    segment stores only the base of a seed made so (shared/protocol/archive/entries.py)."""
    return stable_seed(base, group_id, index)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stops(value) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_STOPS
        and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in value)
    )


# key -> (check, what is expected)
RULES = {
    "temperature": (lambda v: _number(v) and 0 <= v <= 100, "a finite number >= 0 and <= 100"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a finite number > 0 and <= 1"),
    "top_k": (lambda v: _int(v) and 0 <= v < 1 << 31, "an integer >= 0"),
    "max_tokens": (lambda v: _int(v) and 1 <= v <= MAX_TOKENS, f"an integer >= 1 and <= {MAX_TOKENS}"),
    "seed": (lambda v: _int(v) and SEED_RANGE[0] <= v <= SEED_RANGE[1], "a 64-bit integer"),
    "stop_token_ids": (
        lambda v: isinstance(v, list) and len(v) <= 1024 and all(_int(t) and 0 <= t < 1 << 31 for t in v),
        "a list of non-negative integers",
    ),
    # matched on the decoded completion (the rollout worker's calls server): the call ends at the token that
    # completes one; "stop" strings are cut from the answer's text (OpenAI's), "stop_kept" ones stay in it (the
    # gateway's own, e.g. "</tool_call>" for parallel_tool_calls=false)
    "stop": (_stops, f"a list of at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters"),
    "stop_kept": (_stops, f"a list of at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters"),
}


def problem(sampling) -> tuple[str, str] | None:
    """Pure: (field, what is wrong) for the first bad key of ``sampling``, or None when it is fine."""
    if not isinstance(sampling, dict):
        return "", "expected a map"
    for key, value in sampling.items():
        if key not in RULES:
            return str(key), f"unknown sampling key (known: {', '.join(RULES)})"
        ok, expected = RULES[key]
        if not ok(value):
            return key, f"expected {expected}, got {value!r}"[:300]
    return None


def check(entry_id: str, field: str, sampling) -> dict:
    """``sampling`` when it is fine; else EventError naming ``field``.<key>."""
    bad = problem(sampling)
    if bad is not None:
        key, what = bad
        raise EventError(entry_id, f"{field}.{key}" if key else field, what)
    return sampling
