"""When the archiver steps (pure): once the newest published version is ``every_versions`` past the one of its last
step, or ``every_s`` after that step whatever the versions (a slow run still moves). Stepping by versions bounds what
Redis holds at retention + ``every_versions`` versions of episodes at any rate; stepping by time alone held retention
+ ``every_s`` seconds of versions, so the level followed the rate (bench/log/tiers_memory.py)."""

from __future__ import annotations

# Valkey's hz 10 rounds a shorter blocking timeout up to ~100 ms anyway (bench/log/redis_hz.py)
MIN_BLOCK_MS = 100
# one blocking read (or rest) at most: the loop looks at the stop flag at least this often
MAX_BLOCK_MS = 1000
# of the time ``every_versions`` took last time
REST_SHARE = 0.8


def due(newest: int, stepped_at_version: int, waited_s: float, every_versions: int, every_s: float) -> bool:
    """Step now: ``every_versions`` versions published since the last step (``every_versions`` 0: never by versions),
    or ``every_s`` seconds waited."""
    return (every_versions > 0 and newest - stepped_at_version >= every_versions) or waited_s >= every_s


def block_ms(waited_s: float, every_s: float) -> int:
    """How long the next blocking read of the versions stream may wait: until ``every_s`` is up, within
    [MIN_BLOCK_MS, MAX_BLOCK_MS]."""
    left_ms = int((every_s - waited_s) * 1000)
    return max(MIN_BLOCK_MS, min(MAX_BLOCK_MS, left_ms))


def rest_s(versions: int, seconds: float, every_versions: int, every_s: float) -> float:
    """How long the archiver rests after a step before it reads the versions stream again: ``REST_SHARE`` of the
    time ``every_versions`` versions take at the rate between its last two steps (``versions`` published in
    ``seconds``), at most ``every_s``; 0 without a rate. Woken by each version published, it parsed ~50 replies
    a step at 10 versions/s; after the rest, a few (the first read takes every version published meanwhile)."""
    if every_versions <= 0 or versions <= 0 or seconds <= 0:
        return 0.0
    return min(every_s, REST_SHARE * every_versions * seconds / versions)
