"""Long-tail repack vs none, side by side in one run (issue 19). GPU time is SIMULATED: rounds of engine steps.

    python bench/repack.py [--groups 24] [--group-size 4] [--max-tokens 96] [--below 0.25] [--min-tokens 8]

Starts its own EmbeddedRedis in a temp dir and the tiny random-init model (``services.ops.launch.tiny_model``), on CPU.
Two real RolloutWorkers, ticked in turn in this process: one round = one tick of each, so at most one engine step
each, as if each had its own GPU and a step took the same time whatever the batch (the SIMULATED cost model:
time = rounds). Both variants roll out the same prompt groups with the same seeds, so they generate the same
tokens (a repacked episode draws what it would have drawn): only where the steps run differs.

    none    two normal workers (repack off, the default)
    repack  one normal worker with repack_below / repack_min_tokens, one long-tail worker (rollout_role=longtail)

Printed per variant: rounds until every group is published, tokens per round (throughput under the model), each
worker's busy rounds (its engine had work) and mean tokens per busy step (how full its batch was), and the
repack counters; then the ratio none/repack of rounds. Lengths come from the tiny model's stop token, capped at
max_tokens: a geometric-like tail, not a tuned p99/median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from services.ops.launch.tiny_model import make_tiny_model  # noqa: E402
from services.rollout.engine import make_engine  # noqa: E402
from services.rollout.worker import RolloutWorker  # noqa: E402
from shared.protocol.episode.fold import fold  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.protocol.streams import samples as psamples  # noqa: E402
from shared.protocol.streams.prompts import PromptGroup, enqueue  # noqa: E402
from shared.runtime import logs  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402


def _worker(cfg: Config, client, name: str, tok) -> RolloutWorker:
    engine = make_engine("torch", cfg.model_dir, max_batch_size=cfg.max_batch_size)
    worker = RolloutWorker(cfg, client, name, engine, tok, logs.get("bench-repack"))
    worker.start()
    return worker


def run(variant: str, client, model_dir: str, args, tok) -> dict:
    keys = Keys(f"bench-repack-{variant}-{uuid.uuid4().hex[:6]}")
    groups = [PromptGroup(f"g{i}", args.group_size, prompt=f"g{i}: {i}*7=") for i in range(args.groups)]
    enqueue(client, keys, groups)
    base = Config(
        run=keys.run,
        model_dir=model_dir,
        tools="",
        max_tokens=args.max_tokens,
        group_size=args.group_size,
        max_groups_in_flight=args.in_flight,
        heartbeat_ttl=5.0,
        log_level="warning",
    )
    if variant == "none":
        cfgs = [("A", base), ("B", base)]
    else:
        cfgs = [
            ("A", base.replace(repack_below=args.below, repack_min_tokens=args.min_tokens)),
            (
                "L",
                base.replace(
                    rollout_role="longtail",
                    max_groups_in_flight=args.tail_in_flight,
                    longtail_claim_share=args.tail_share,
                ),
            ),
        ]
    workers = [(name, _worker(cfg, client, name, tok)) for name, cfg in cfgs]
    busy = {name: 0 for name, _ in workers}
    rounds = 0
    while len(psamples.read_all(client, keys.samples)[0]) < len(groups):
        rounds += 1
        for name, w in workers:
            busy[name] += w.engine.has_unfinished() and not w.paused
            w.tick(block_ms=0)
        if rounds > 100_000:
            raise RuntimeError(f"{variant}: not finished after {rounds} rounds")
    out = {"variant": variant, "rounds": rounds, "busy": busy, "stats": {n: w.stats for n, w in workers}}
    lengths = [len(fold(client.xrange(keys.episode(eid))).tokens) for g in groups for eid in g.episode_ids()]
    out["tokens"] = sum(lengths)
    out["median_len"], out["max_len"] = statistics.median(lengths), max(lengths)
    for _, w in workers:
        w.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--in-flight", type=int, default=4, help="max_groups_in_flight of each worker")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--below", type=float, default=0.25, help="repack_below of the normal worker")
    p.add_argument("--min-tokens", type=int, default=8, help="repack_min_tokens")
    p.add_argument("--tail-in-flight", type=int, default=8, help="max_groups_in_flight of the long-tail worker")
    p.add_argument("--tail-share", type=float, default=0.5, help="longtail_claim_share of the long-tail worker")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-repack-")
    server = EmbeddedRedis(Path(tmp) / "redis").start()
    try:
        client = connect(server.url)
        model_dir = make_tiny_model(str(Path(tmp) / "tiny"))
        tok = AutoTokenizer.from_pretrained(model_dir)
        results = [run(v, client, model_dir, args, tok) for v in ("none", "repack")]
    finally:
        server.stop()
    print(
        f"{args.groups} groups x {args.group_size} episodes, max_tokens {args.max_tokens}, "
        f"{args.in_flight} groups in flight per worker (long-tail worker: {args.tail_in_flight}, claim share "
        f"{args.tail_share}); SIMULATED time: one round = one engine step per worker"
    )
    for r in results:
        print(
            f"{r['variant']:>6}: {r['rounds']} rounds, {r['tokens']} tokens (median episode {r['median_len']}, "
            f"max {r['max_len']}), {r['tokens'] / r['rounds']:.2f} tokens/round"
        )
        for name, st in r["stats"].items():
            steps = max(1, r["busy"][name])
            print(
                f"        {name}: busy {r['busy'][name]}/{r['rounds']} rounds, {st['tokens'] / steps:.2f} tokens per "
                f"busy step, groups {st['groups']}, repacked out {st['repacked_groups']} groups / "
                f"{st['repacked_episodes']} episodes / {st['repacked_tokens']} tokens, repacked in "
                f"{st['repacked_in']}, saved steps (est.) {st['repack_saved_steps']}"
            )
    none, rep = results
    print(f"rounds none/repack = {none['rounds'] / rep['rounds']:.2f}; same tokens: {none['tokens'] == rep['tokens']}")


if __name__ == "__main__":
    main()
