"""Load a user function named by a config ``module:function`` spec (tools, rewards)."""

from __future__ import annotations

import importlib
from typing import Callable


def load(spec: str, key: str) -> Callable:
    """The function ``spec`` names; ValueError naming the config ``key`` and the spec when it cannot be loaded."""
    module, sep, name = spec.strip().partition(":")
    if not sep or not module or not name:
        raise ValueError(f"config key {key!r}: {spec!r}: expected 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"config key {key!r}: {spec!r}: cannot load ({exc})") from None
    if not callable(fn):
        raise ValueError(f"config key {key!r}: {spec!r}: not callable")
    return fn
