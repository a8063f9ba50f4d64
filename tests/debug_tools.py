"""Debug tools for tests and drills, loaded by spec (``tools = "tests.debug_tools:sleep,..."``); never in the
production registry."""

from __future__ import annotations

import time

SPECS = "tests.debug_tools:sleep,tests.debug_tools:crash,tests.debug_tools:garbage"


def sleep(args: str) -> str:
    """Sleeps ARGS seconds, then echoes them (slow tools)."""
    time.sleep(float(args))
    return args


def crash(args: str) -> str:
    raise RuntimeError(f"crash tool asked to fail: {args}")


def garbage(args: str):
    return {"not": "a string"}
