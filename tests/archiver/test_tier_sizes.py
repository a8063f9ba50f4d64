"""`streamrl status` and the driver's progress line show Redis's memory and keys and the segments on disk."""

from __future__ import annotations

import re

from services.driver.status import format_line, snapshot
from shared.protocol.archive import tiers
from tests.archiver.tiers_support import one_segment


def test_the_status_line_shows_redis_memory_keys_and_the_segments(client, keys, tmp_path):
    eids, _, _ = one_segment(client, keys, tmp_path, versions=3)
    snap = snapshot(client, keys, tmp_path)
    t = snap["tiers"]
    assert t["redis_keys"] == client.dbsize() > len(eids)
    # INFO memory: used_memory
    assert t["redis_used_memory"] > 100_000
    assert (t["segments"], t["segment_episodes"]) == (1, len(eids))
    line = format_line(snap)
    assert re.search(
        rf"redis [\d.]+ MB( of [\d.]+ GB)?, {t['redis_keys']:,} keys; segments [\d.]+ MB, "
        rf"{len(eids)} episodes",
        line,
    ), line
    no_segments = format_line(snapshot(client, keys, tmp_path / "elsewhere"))
    # no segment yet: Redis alone
    assert "keys" in no_segments and "segments" not in no_segments


def test_describe_says_the_cap_when_there_is_one():
    t = {
        "redis_used_memory": 47_100_000,
        "redis_maxmemory": 4_294_967_296,
        "redis_keys": 79893,
        "segments": 32,
        "segment_episodes": 18176,
        "segment_bytes": 561_781,
    }
    assert tiers.describe(t) == "redis 47.1 MB of 4.3 GB, 79,893 keys; segments 0.6 MB, 18,176 episodes"
    assert tiers.describe({**t, "redis_maxmemory": 0, "segments": 0}) == "redis 47.1 MB, 79,893 keys"
