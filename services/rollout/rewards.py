"""Reward functions: ``module:function(response_text, task) -> float | (float, dict)``.

The default task is integer arithmetic: the episode's response must contain
``answer: N`` (or end with the number) equal to ``task["answer"]``.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable

ANSWER_RE = re.compile(r"answer:\s*(-?\d+)")
LAST_INT_RE = re.compile(r"(-?\d+)\s*$")


def arithmetic(response: str, task: dict) -> tuple[float, dict]:
    text = re.sub(r"<result>.*?</result>", "", response, flags=re.S)
    m = ANSWER_RE.search(text) or LAST_INT_RE.search(text.replace("<eos>", "").strip())
    got = m.group(1) if m else None
    expected = str(task.get("answer", "")).strip()
    return (1.0 if got is not None and got == expected else 0.0), {"parsed": got, "expected": expected}


def load(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward_fn {spec!r}: cannot load ({exc})") from None
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r}: not callable")
    return fn


def score(fn: Callable, response: str, task: dict) -> tuple[float, dict]:
    """Call a reward function and normalise what it returns; errors say what came back."""
    out = fn(response, task)
    reward, details = (out if isinstance(out, tuple) else (out, {}))
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"reward function returned {type(reward).__name__}, expected a number")
    return float(reward), dict(details or {})
