"""Debug tools for tests and drills, loaded by spec (``tools = "tests.support.debug_tools:sleep,..."``); never in the
production registry."""

from __future__ import annotations

import time

SPECS = "tests.support.debug_tools:sleep,tests.support.debug_tools:crash,tests.support.debug_tools:garbage"


def sleep(args: str) -> str:
    """Sleeps ARGS seconds, then echoes them (slow tools)."""
    time.sleep(float(args))
    return args


def crash(args: str) -> str:
    raise RuntimeError(f"crash tool asked to fail: {args}")


def garbage(args: str):
    return {"not": "a string"}


# --- debug rewards (config reward_fn = "tests.support.debug_tools:NAME")


async def slow_reward(response: str, task: dict, prompt: str = "") -> tuple[float, dict]:
    """Async; sleeps task["sleep"] seconds (default 0), then scores 1.0 and echoes the prompt it was given."""
    import asyncio

    await asyncio.sleep(float(task.get("sleep", 0)))
    return 1.0, {"prompt": prompt}


def raising_reward(response: str, task: dict) -> float:
    if task.get("raise"):
        raise RuntimeError(f"reward asked to fail: {task['raise']}")
    return 0.5


def longest_in_group(response: str, task: dict, group: list) -> tuple[float, dict]:
    """Group-aware: 1.0 for the group's longest response(s)."""
    longest = max(len(g["response"]) for g in group)
    return float(len(response) == longest), {"indices": [g["index"] for g in group], "longest": longest}
