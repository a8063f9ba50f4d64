"""Reward functions: config ``reward_fn = "module:function"``.

A reward function is ``fn(response, task, *, prompt=...) -> float | (float, dict)``, plain or ``async def``:
``response`` is the episode's response text (tool calls and results included), ``task`` the prompt group's
task row (e.g. its ground truth), and ``prompt`` (passed only when the function declares it, or ``**kwargs``)
the prompt text. It runs as an rq job (``run_reward``, JSON serializer) on the run's tools queue, so a slow
or crashing reward never blocks decoding or heartbeats; an error becomes the episode's ``failed`` event.

A function marked ``@inline`` (the built-in ``arithmetic``: a regex, microseconds) is called in the rollout
worker instead: an rq round trip costs milliseconds (bench/rewards.py).

The default task is integer arithmetic: the episode's response must contain ``answer: N`` (or end with the
number) equal to ``task["answer"]``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
from dataclasses import dataclass
from typing import Callable

from services.rollout import specs

ANSWER_RE = re.compile(r"answer:\s*(-?\d+)")
LAST_INT_RE = re.compile(r"(-?\d+)\s*$")


def inline(fn: Callable) -> Callable:
    """Mark a cheap, synchronous reward function to be called in the rollout worker (no rq job)."""
    fn.streamrl_inline = True
    return fn


@inline
def arithmetic(response: str, task: dict) -> tuple[float, dict]:
    text = re.sub(r"<result>.*?</result>", "", response, flags=re.S)
    m = ANSWER_RE.search(text) or LAST_INT_RE.search(text.replace("<eos>", "").strip())
    got = m.group(1) if m else None
    expected = str(task.get("answer", "")).strip()
    return (1.0 if got is not None and got == expected else 0.0), {"parsed": got, "expected": expected}


@dataclass(frozen=True)
class Reward:
    spec: str
    fn: Callable

    @property
    def inline(self) -> bool:
        return bool(getattr(self.fn, "streamrl_inline", False)) and not inspect.iscoroutinefunction(self.fn)

    def __call__(self, response: str, task: dict, prompt: str = "") -> tuple[float, dict]:
        return score(self.fn, response, task, prompt)


@functools.lru_cache(maxsize=16)
def load(spec: str) -> Reward:
    return Reward(spec, specs.load(spec, "reward_fn"))


@functools.lru_cache(maxsize=64)
def _takes_prompt(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "prompt" or p.kind is p.VAR_KEYWORD for p in params)


def score(fn: Callable, response: str, task: dict, prompt: str = "") -> tuple[float, dict]:
    """Call a reward function (awaiting it when async) and normalise what it returns; errors say what came back."""
    out = fn(response, task, prompt=prompt) if _takes_prompt(fn) else fn(response, task)
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    reward, details = (out if isinstance(out, tuple) else (out, {}))
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"reward function returned {type(reward).__name__}, expected a number")
    return float(reward), dict(details or {})


async def _awaited(awaitable):
    return await awaitable


def run_reward(spec: str, prompt: str, response: str, task: dict) -> list:
    """The rq job: score one episode; returns [reward, details] (JSON)."""
    return list(load(spec)(response, task, prompt))
