"""Reward functions: config ``reward_fn = "module:function"``.

A reward function is ``fn(response, task, *, prompt=..., group=...) -> float | (float, dict)``, plain or
``async def``: ``response`` is the episode's response text (tool calls and results included), ``task`` the
prompt group's task row (e.g. its ground truth), ``prompt`` (passed only when the function declares it, or
``**kwargs``) the prompt text.

Group-aware rewards declare a ``group`` parameter: the worker then scores a group's episodes only once all of them have
finished generating, each call getting ``group = [{"index": i, "response": text}, ...]`` (index order) of the group's
episodes scored together: all of them, less any that failed (or, after a takeover, were already scored by the previous
worker). It runs as an rq job (``run_reward``, JSON serializer) on the run's tools queue, so a slow or crashing reward
never blocks decoding or heartbeats; an error becomes the episode's ``failed`` event.

A function marked ``@inline`` (the built-in ``arithmetic``: a regex, microseconds) is called in the rollout
worker instead: an rq round trip costs milliseconds (bench/learning/rewards.py).

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

from shared.runtime import specs

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
        return (
            bool(getattr(self.fn, "streamrl_inline", False))
            and not inspect.iscoroutinefunction(self.fn)
            and not self.group_aware
        )

    @property
    def group_aware(self) -> bool:
        return "group" in _params(self.fn)

    def __call__(self, response: str, task: dict, prompt: str = "", group: list | None = None) -> tuple[float, dict]:
        return score(self.fn, response, task, prompt, group)


@functools.lru_cache(maxsize=16)
def load(spec: str) -> Reward:
    return Reward(spec, specs.load(spec, "reward_fn"))


@functools.lru_cache(maxsize=64)
def _params(fn: Callable) -> frozenset[str]:
    """Which of prompt and group ``fn`` takes (``**kwargs`` takes the prompt; group-aware is declared by name)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset()
    names = {p.name for p in params if p.name in ("prompt", "group")}
    return frozenset(names | ({"prompt"} if any(p.kind is p.VAR_KEYWORD for p in params) else set()))


def score(fn: Callable, response: str, task: dict, prompt: str = "", group: list | None = None) -> tuple[float, dict]:
    """Call a reward function (awaiting it when async) and normalise what it returns; errors say what came back."""
    extra = {"prompt": prompt, "group": group or [{"index": 0, "response": response}]}
    out = fn(response, task, **{k: v for k, v in extra.items() if k in _params(fn)})
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    reward, details = out if isinstance(out, tuple) else (out, {})
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"reward function returned {type(reward).__name__}, expected a number")
    return float(reward), dict(details or {})


async def _awaited(awaitable):
    return await awaitable


def run_reward(spec: str, prompt: str, response: str, task: dict, group: list | None = None) -> list:
    """The rq job: score one episode; returns [reward, details] (JSON)."""
    return list(load(spec)(response, task, prompt, group))
