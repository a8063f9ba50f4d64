"""Stop strings in answers (OpenAI's semantics): the answer's text ends just before the stop string that ended
the call, and a stream never sends text that may yet turn out to be the start of one. The rollout worker ends
the call at the token that completes the string (services/rollout/engine/stops.py); the training row keeps that
token, the answer does not show the string."""

from __future__ import annotations

from collections.abc import Sequence


def cut(text: str, stop: str | None) -> str:
    """``text`` up to the first ``stop`` in it (all of it when there is none)."""
    at = text.find(stop) if stop else -1
    return text if at < 0 else text[:at]


def safe_len(text: str, stops: Sequence[str]) -> int:
    """How much of a growing completion text may be streamed now: up to the first stop string in it, and short of
    a tail that could still become one."""
    found = [at for s in stops if (at := text.find(s)) >= 0]
    if found:
        return min(found)
    for k in range(min(max(map(len, stops), default=1) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return len(text) - k
    return len(text)
