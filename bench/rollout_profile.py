"""Where the Redis episode log's extra cost goes in the rollout throughput benchmark (issue 14 item 5).

    python bench/rollout_profile.py [--reps 3] [--max-tokens 32] [--groups 48]

Runs ``bench/rollout.py``'s throughput case (a real RolloutWorker, tiny random-init model, the Redis EpisodeLog
against the in-memory sink, interleaved) and prints, per sink, the median over reps of: wall seconds, entries,
the Redis server's CPU seconds (``INFO cpu``), the append scripts' calls and cost (``INFO commandstats``, the fence
command inside them), the CPU seconds of the writer thread inside ``EpisodeLog.send`` (``time.thread_time``), and
the worker thread's cumulative time opening groups and waiting for a batch (cProfile of the worker's thread).
cProfile slows the client down: read the client figures as a split between parts, not as absolute costs.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import bench.rollout as br  # noqa: E402
from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from services.ops.launch.tiny_model import load_tokenizer, make_tiny_model  # noqa: E402
from services.rollout.engine.torch_engine import TorchEngine  # noqa: E402
from shared.protocol.episode.log import EpisodeLog  # noqa: E402
from shared.runtime import logs  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402

_send_cpu = [0.0]
_send = EpisodeLog.send


def _timed_send(self, batch, also=None):
    t0 = time.thread_time()
    try:
        return _send(self, batch, also)
    finally:
        _send_cpu[0] += time.thread_time() - t0


def _command(stats: dict, name: str, field: str) -> float:
    return stats.get(f"cmdstat_{name}", {}).get(field, 0)


def one_run(client, engine, tok, cfg, sink: str, n_groups: int, log) -> dict:
    _send_cpu[0] = 0.0
    client.config_resetstat()
    server0 = br.server_cpu(client)
    prof = cProfile.Profile()
    prof.enable()
    r = br.rollout_once(client, engine, tok, cfg, sink, n_groups, log)
    prof.disable()
    cum = {k[2]: v[3] for k, v in pstats.Stats(prof).stats.items() if k[0].endswith("episodes.py")}
    cs = client.info("commandstats")
    return {
        "wall_s": r["seconds"],
        "entries": r["entries"],
        "server_cpu_s": br.server_cpu(client) - server0,
        "evalsha_calls": _command(cs, "evalsha", "calls"),
        "evalsha_us_per_call": _command(cs, "evalsha", "usec_per_call"),
        "fence_ms": (_command(cs, "xrevrange", "usec") + _command(cs, "xlen", "usec")) / 1e3,
        "xadd_calls": _command(cs, "xadd", "calls"),
        "writer_thread_cpu_s": _send_cpu[0],
        "open_groups_ms": cum.get("open_groups", 0.0) * 1e3,
        "settle_ms": cum.get("settle", 0.0) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--groups", type=int, default=48)
    args = ap.parse_args(argv)
    logs.setup("warning")
    torch.set_num_threads(1)
    EpisodeLog.send = _timed_send
    runs: dict[str, list[dict]] = {"redis": [], "memory": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        server = EmbeddedRedis(tmp / "redis").start()
        try:
            client = connect(server.url)
            model_dir = make_tiny_model(tmp / "tiny")
            cfg = Config(model_dir=model_dir, tools="", temperature=1.0, max_tokens=args.max_tokens)
            tok = load_tokenizer(model_dir)
            engine = TorchEngine(model_dir, max_batch_size=cfg.max_batch_size)
            log = logs.get("bench")
            # warm-up
            br.rollout_once(client, engine, tok, cfg, "redis", max(2, args.groups // 4), log)
            for rep in range(args.reps):
                for sink in ("redis", "memory") if rep % 2 == 0 else ("memory", "redis"):
                    runs[sink].append(one_run(client, engine, tok, cfg, sink, args.groups, log))
                    print(f"rep {rep} {sink} done", file=sys.stderr, flush=True)
        finally:
            server.stop()
    names = list(runs["redis"][0])
    print(f"median of {args.reps} interleaved reps, max_tokens {args.max_tokens}, {args.groups} groups")
    print(f"{'':22} {'redis':>12} {'memory':>12} {'redis - memory':>15}")
    for name in names:
        r, m = (statistics.median(run[name] for run in runs[s]) for s in ("redis", "memory"))
        print(f"{name:22} {r:>12.3f} {m:>12.3f} {r - m:>15.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
