"""Bytes per policy token in each tier of the episode log: an episode's Redis stream (MEMORY USAGE) and its row in
a zstd Parquet segment (shared/protocol/archive/segments.py), for short episodes (the default run's shape: 8 tokens in
entries of ~2-3) and for 256-token episodes (entries of 16, the flush rule's size).

    python bench/tiers.py [--episodes N]

Token ids are drawn from a 32k vocabulary by a Zipf law, log-probs as a sampler's are (most near 0, a tail of
unlikely tokens, 30 % exactly 0.0), float32: synthetic, said so in the result. Episodes come in groups of 8 that
share their prompt (24 Zipf ids), each with its own sampling seed made by the rollout's rule, as in a run; one
segment of ``--episodes`` rows (the archiver's batch is 2,000). Prints where the bytes go, column by column."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from shared.protocol.archive import builder as segment_builder  # noqa: E402
from shared.protocol.archive import segments
from shared.protocol.episode.log import EpisodeLog  # noqa: E402
from shared.protocol.episode.sampling import episode_seed  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402

# episodes per group (the default group_size)
GROUP = 8
# the run's seed (the default)
SEED = 0


def _zipf(rng, n: int) -> list[int]:
    return np.minimum(rng.zipf(1.3, n), 32000).astype(int).tolist()


def columns(path: Path, tokens: int) -> dict[str, float]:
    """Bytes per token of each column of a segment file (compressed), and of the file's footer."""
    meta = pq.ParquetFile(path).metadata
    out: dict[str, float] = {}
    for i in range(meta.num_columns):
        c = meta.row_group(0).column(i)
        name = c.path_in_schema.split(".")[0]
        out[name] = out.get(name, 0) + c.total_compressed_size / tokens
    out["(footer)"] = (
        path.stat().st_size - sum(meta.row_group(0).column(i).total_compressed_size for i in range(meta.num_columns))
    ) / tokens
    return out


def folder_columns(folder: Path) -> dict[str, int]:
    """Compressed bytes of each column over every segment file in a folder (all row groups), and their footers."""
    out: dict[str, int] = {}
    for path in sorted(folder.glob("seg-*.parquet")):
        meta = pq.ParquetFile(path).metadata
        body = 0
        for g in range(meta.num_row_groups):
            for i in range(meta.num_columns):
                c = meta.row_group(g).column(i)
                name = c.path_in_schema.split(".")[0]
                out[name] = out.get(name, 0) + c.total_compressed_size
                body += c.total_compressed_size
        out["(footer)"] = out.get("(footer)", 0) + path.stat().st_size - body
    return out


def measure(client, folder: Path, n_episodes: int, n_tokens: int, chunk: int, rng) -> dict:
    keys = Keys(f"b{uuid.uuid4().hex[:8]}")
    log = EpisodeLog(client, keys, "bench")
    eids = [f"q000-{g:06d}-{i}" for g in range(-(-n_episodes // GROUP)) for i in range(GROUP)][:n_episodes]
    prompts = {}
    for eid in eids:
        group_id, index = eid.rsplit("-", 1)
        # a group's episodes share their prompt, as in a run
        if group_id not in prompts:
            prompts[group_id] = _zipf(rng, 24)
        log.open(eid)
        sampling = {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "max_tokens": n_tokens,
            "stop_token_ids": [2],
            # the rollout's own
            "seed": episode_seed(SEED, group_id, int(index)),
        }
        log.append(
            eid,
            "started",
            {
                "episode_id": eid,
                "group_id": group_id,
                "index": int(index),
                "prompt_ids": prompts[group_id],
                "sampling": sampling,
                "task": {"answer": "42"},
            },
            3,
        )
        ids = _zipf(rng, n_tokens)
        lps = np.where(rng.random(n_tokens) < 0.7, -rng.exponential(0.3, n_tokens), 0.0).astype(np.float32).tolist()
        for s in range(0, n_tokens, chunk):
            log.append_tokens(eid, ids[s : s + chunk], lps[s : s + chunk], 3)
            log.flush_or_raise([eid])
        log.append(eid, "finished", {"reason": "length", "reward": 1.0, "details": {}}, 3)
        log.flush_or_raise([eid])
        log.close(eid)
    redis_bytes = sum(client.memory_usage(keys.episode(e), samples=0) for e in eids)
    table = segment_builder.table_of(((e, client.xrange(keys.episode(e))) for e in eids), SEED)
    name = f"seg-{n_tokens:08d}.parquet"
    size = segments.write_file(folder, name, table)
    client.delete(*[keys.episode(e) for e in eids])
    tokens = n_episodes * n_tokens
    return {
        "redis_per_token": redis_bytes / tokens,
        "segment_per_token": size / tokens,
        "columns": columns(folder / name, tokens),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=2000, help="episodes of the 8-token segment (1/8 as many of 256)")
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
        print(
            f"{label}: Redis {m['redis_per_token']:.1f} B/token, segment {m['segment_per_token']:.2f} B/token "
            f"({m['redis_per_token'] / m['segment_per_token']:.0f}x smaller)"
        )
        print(
            "  by column (B/token): "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(m["columns"].items(), key=lambda kv: -kv[1]))
        )
    print(f"load average {load:.2f}")
    record(
        "tiers",
        [
            {
                "what": "episode log bytes per policy token, Redis -> segment (8-token episodes)",
                "value": f"{short['redis_per_token']:.0f} -> {short['segment_per_token']:.1f}",
            },
            {
                "what": "episode log bytes per policy token, Redis -> segment (256-token episodes)",
                "value": f"{long['redis_per_token']:.0f} -> {long['segment_per_token']:.1f}",
            },
        ],
        [
            "shared/protocol/archive/segments.py",
            "shared/protocol/archive/entries.py",
            "shared/protocol/archive/builder.py",
            "shared/protocol/episode/log.py",
        ],
        simulated="token ids (Zipf over 32k) and log-probs (float32, 70% from an exponential, 30% exactly 0) drawn "
        "at random; groups of 8 share a 24-token Zipf prompt",
        extra={
            "load_average": load,
            "episodes": args.episodes,
            "columns_8": {k: round(v, 3) for k, v in short["columns"].items()},
            "columns_256": {k: round(v, 3) for k, v in long["columns"].items()},
        },
    )


if __name__ == "__main__":
    main()
