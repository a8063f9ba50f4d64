"""How big each tier of the episode log is now: the Redis server's memory and key count, and the run's segments on
disk (shared/protocol/archive/segments.py). Shown by ``streamrl status`` and the driver's progress line."""

from __future__ import annotations

from pathlib import Path

from shared.protocol.archive import segments


def _total(reply, name: str) -> int:
    """A field of INFO: one server's reply, or a cluster's (one reply per node: summed)."""
    if name in reply:
        return int(reply[name])
    return sum(int(node.get(name, 0)) for node in reply.values() if isinstance(node, dict))


def sizes(client, run_path: Path | str | None) -> dict:
    """{redis_used_memory, redis_maxmemory, redis_keys, segments, segment_episodes, segment_bytes, segment_tokens}."""
    memory = client.info("memory")
    dbsize = client.dbsize()
    out = {
        "redis_used_memory": _total(memory, "used_memory"),
        "redis_maxmemory": _total(memory, "maxmemory"),
        "redis_keys": dbsize if isinstance(dbsize, int) else sum(dbsize.values()),
    }
    cold = segments.SegmentStore(segments.folder_of(run_path)).sizes() if run_path else {}
    out.update(
        segments=cold.get("segments", 0),
        segment_episodes=cold.get("episodes", 0),
        segment_bytes=cold.get("bytes", 0),
        segment_tokens=cold.get("tokens", 0),
    )
    return out


def describe(t: dict) -> str:
    """``redis 47.1 MB of 4.3 GB, 79,893 keys; segments 0.6 MB, 18,176 episodes`` (pure)."""
    cap = f" of {t['redis_maxmemory'] / 1e9:.1f} GB" if t.get("redis_maxmemory") else ""
    line = f"redis {t['redis_used_memory'] / 1e6:.1f} MB{cap}, {t['redis_keys']:,} keys"
    if t.get("segments"):
        line += f"; segments {t['segment_bytes'] / 1e6:.1f} MB, {t['segment_episodes']:,} episodes"
    return line
