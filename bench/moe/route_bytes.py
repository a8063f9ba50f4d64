"""Bytes per policy token that an MoE policy's routes cost in the episode log: in the wire form (routes.pack: one
byte per expert index, layers × top-k per token), as the wire planes compressed alone by the segment tier's
compressor (zstd at the segment level), and in each tier: the same real episodes written through the episode log
into Redis (their entries' field and value bytes, and MEMORY USAGE, which counts allocations) and moved into a zstd
Parquet segment (shared/protocol/archive/), once with their routes and once without."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.log.tiers import columns
from services.ops.launch.redis_server import EmbeddedRedis
from shared.protocol.archive import builder as segment_builder
from shared.protocol.archive import segments
from shared.protocol.episode.fold import Episode
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.episode.routes import RouteShape, canonical, pack
from shared.protocol.episode.sampling import episode_seed
from shared.protocol.keys import Keys
from shared.runtime.connection import connect

# the run's seed (the default)
SEED = 0


def write_episodes(client, episodes: list[Episode], shape: RouteShape, with_routes: bool) -> tuple[Keys, list[str]]:
    """Each episode through the episode log as a run writes it: started, its tokens (one entry), finished."""
    keys = Keys(f"b{uuid.uuid4().hex[:8]}")
    log = EpisodeLog(client, keys, "bench")
    eids = []
    for ep in episodes:
        eid = f"q{ep.group_id}-{ep.index}"
        eids.append(eid)
        log.open(eid)
        sampling = {"temperature": 1.0, "max_tokens": 32, "seed": episode_seed(SEED, ep.group_id, ep.index)}
        started = {"episode_id": eid, "group_id": ep.group_id, "index": ep.index, "prompt_ids": ep.prompt_ids}
        log.append(eid, "started", {**started, "sampling": sampling, "task": ep.task}, ep.versions[0])
        routes = canonical(np.stack(ep.routes), shape) if with_routes else None
        log.append_tokens(eid, ep.tokens, ep.logprobs, ep.versions[0], routes)
        log.append(eid, "finished", {"reason": ep.finish_reason, "reward": ep.reward, "details": {}}, ep.versions[0])
        log.flush_or_raise([eid])
        log.close(eid)
    return keys, eids


def tiers(client, folder: Path, episodes: list[Episode], shape: RouteShape, with_routes: bool) -> dict:
    """Redis and segment bytes per policy token of ``episodes``, with or without their routes."""
    keys, eids = write_episodes(client, episodes, shape, with_routes)
    tokens = sum(len(ep.tokens) for ep in episodes)
    redis_bytes = sum(client.memory_usage(keys.episode(e), samples=0) for e in eids)
    streams = [(e, client.xrange(keys.episode(e))) for e in eids]
    entry_bytes = sum(len(k) + len(v) for _, entries in streams for _, fields in entries for k, v in fields.items())
    table = segment_builder.table_of(streams, SEED)
    name = f"seg-{'routes' if with_routes else 'plain'}.parquet"
    size = segments.write_file(folder, name, table)
    client.delete(*[keys.episode(e) for e in eids])
    return {
        "redis_per_token": redis_bytes / tokens,
        "entry_per_token": entry_bytes / tokens,
        "segment_per_token": size / tokens,
        "columns": {k: round(v, 3) for k, v in columns(folder / name, tokens).items()},
    }


def measure(episodes: list[Episode], shape: RouteShape) -> dict:
    """Every figure of the module docstring, on ``episodes`` (each token with its route)."""
    routes = [canonical(np.stack(ep.routes), shape) for ep in episodes]
    tokens = sum(len(r) for r in routes)
    wire = sum(len(pack(r)["planes"]) for r in routes)
    # the planes of every episode one after another, as one segment would hold them, by the segment's compressor
    planes = b"".join(pack(r)["planes"] for r in routes)
    zstd = len(pa.Codec("zstd", compression_level=segments.LEVEL).compress(planes, asbytes=True))
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis").start()
        try:
            client = connect(server.url)
            plain = tiers(client, Path(tmp) / "seg", episodes, shape, with_routes=False)
            routed = tiers(client, Path(tmp) / "seg", episodes, shape, with_routes=True)
        finally:
            server.stop()
    return {
        "episodes": len(episodes),
        "policy_tokens": tokens,
        "shape": shape.to_dict(),
        "wire_per_token": wire / tokens,
        "wire_per_token_per_layer": wire / tokens / shape.layers,
        "planes_zstd_per_token": zstd / tokens,
        "without_routes": plain,
        "with_routes": routed,
        "segment_routes_per_token": routed["segment_per_token"] - plain["segment_per_token"],
        "redis_routes_per_token": routed["redis_per_token"] - plain["redis_per_token"],
        "entry_routes_per_token": routed["entry_per_token"] - plain["entry_per_token"],
    }
