"""Bytes per policy token in each tier of the episode log: an episode's Redis stream (MEMORY USAGE) and its row in
a zstd Parquet segment (shared/protocol/segments.py), for short episodes (the default run's shape: 8 tokens in
entries of ~2-3) and for 256-token episodes (entries of 16, the flush rule's size).

    python bench/tiers.py [--episodes N]

Token ids are drawn from a 32k vocabulary by a Zipf law, log-probs as a sampler's are (most near 0, a tail of
unlikely tokens), float32: synthetic, said so in the result. Real runs' token streams compress at least as well
(repeated ids, peaked log-probs)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from services.ops.redis_server import EmbeddedRedis  # noqa: E402
from shared.protocol import segments  # noqa: E402
from shared.protocol.episode_log import EpisodeLog  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402


def measure(client, folder: Path, n_episodes: int, n_tokens: int, chunk: int, rng) -> dict:
    keys = Keys(f"b{uuid.uuid4().hex[:8]}")
    log = EpisodeLog(client, keys, "bench")
    eids = [f"e{i}" for i in range(n_episodes)]
    for eid in eids:
        log.open(eid)
        log.append(eid, "started", {"episode_id": eid, "group_id": eid[:-1] or "g", "index": 0,
                                    "prompt_ids": [int(x) for x in rng.integers(0, 32000, 24)],
                                    "sampling": {"max_tokens": n_tokens}, "task": {"answer": "42"}}, 3)
        ids = np.minimum(rng.zipf(1.3, n_tokens), 32000).astype(int).tolist()
        lps = (-rng.exponential(0.3, n_tokens) * (rng.random(n_tokens) < 0.7)).astype(np.float32).tolist()
        for s in range(0, n_tokens, chunk):
            log.append_tokens(eid, ids[s:s + chunk], lps[s:s + chunk], 3)
            log.flush_or_raise([eid])
        log.append(eid, "finished", {"reason": "length", "reward": 1.0, "details": {}}, 3)
        log.flush_or_raise([eid])
        log.close(eid)
    redis_bytes = sum(client.memory_usage(keys.episode(e), samples=0) for e in eids)
    rows = [segments.to_row(e, client.xrange(keys.episode(e))) for e in eids]
    name = f"seg-{n_tokens:08d}.parquet"
    size = segments.write_file(folder, name, rows)
    client.delete(*[keys.episode(e) for e in eids])
    tokens = n_episodes * n_tokens
    return {"redis_per_token": redis_bytes / tokens, "segment_per_token": size / tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=2000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis").start()
        try:
            client = connect(server.url)
            short = measure(client, Path(tmp) / "seg", args.episodes, 8, 3, rng)
            long = measure(client, Path(tmp) / "seg", max(1, args.episodes // 8), 256, 16, rng)
        finally:
            server.stop()
    load = os.getloadavg()[0]
    for label, m in (("8-token episodes (default run shape)", short), ("256-token episodes", long)):
        print(f"{label}: Redis {m['redis_per_token']:.1f} B/token, segment {m['segment_per_token']:.2f} B/token "
              f"({m['redis_per_token'] / m['segment_per_token']:.0f}x smaller)")
    print(f"load average {load:.2f}")
    record("tiers", [
        {"what": "episode log bytes per policy token, Redis -> segment (8-token episodes)",
         "value": f"{short['redis_per_token']:.0f} -> {short['segment_per_token']:.1f}"},
        {"what": "episode log bytes per policy token, Redis -> segment (256-token episodes)",
         "value": f"{long['redis_per_token']:.0f} -> {long['segment_per_token']:.1f}"},
    ], ["shared/protocol/segments.py", "shared/protocol/episode_log.py"],
        simulated="token ids (Zipf over 32k) and log-probs (float32, 70% from an exponential, 30% exactly 0) drawn "
                  "at random", extra={"load_average": load})


if __name__ == "__main__":
    main()
