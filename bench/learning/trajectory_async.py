"""Trajectory-level asynchrony, side by side in one run: several rollout workers under the simulated
GPU cost model, long-tailed response lengths, the same task, model, seeds and sample budget for every variant:

    sync      ``mode=sync``, ``max_staleness=0``: generate a batch with version v, train, publish, sync, repeat
    global    ``mode=async``: every new version pauses EVERY rollout worker at once (pause, load, resume)
    repack    ``global``, and long-tail episodes repacked onto a long-tail worker (one of the N)
    rolling   ``mode=async`` with rolling version changes (at most ``max_loading`` workers paused at once),
              weights pulled through worker relays, and long-tail episodes repacked onto a long-tail worker
    pull      ``rolling``'s relays and repack, but each version announced, not forced (``sync_mode=pull``): every
              worker downloads it from its relay parent while it generates and loads it at a cheap point of its
              own, at most ``max_loading`` loading at once

Each variant is a whole ``streamrl run`` (embedded Redis, every Procfile process, ``rollout_workers`` rollout
processes). The task is ``chain_sum``: the reference responses' lengths (characters = tokens of the tiny
tokenizer, + EOS) have a median of 5 and a p99 of 64, about 13x (printed at the start). Columns, beside
bench/learning/async_vs_sync.py's: rollout busy (engine-step time / wall time, mean over the workers: the workers'
own counters), repacks and tokens moved. The variants' config keys are in VARIANTS; a key this tree does not
have is one line naming it.

SIMULATED COST: every engine step sleeps ``--step-delay-ms`` (a memory-bound GPU decode step costs about the
same whatever the batch), the trainer sleeps per trained token, and with ``--simulated-load-ms`` every weight load
in a worker sleeps too (a large model's load takes seconds on a GPU, the tiny model's milliseconds); printed with
every result. Usage:

    PYTHONPATH=. python bench/learning/trajectory_async.py                  # 8 workers, ~15-25 min on a 2-core box
    PYTHONPATH=. python bench/learning/trajectory_async.py --quick --workers 4
    PYTHONPATH=. python bench/learning/trajectory_async.py --variants global,rolling --seeds 2
    # pull: not in the default set
    PYTHONPATH=. python bench/learning/trajectory_async.py --variants global,rolling,pull
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.learning.async_vs_sync import (  # noqa: E402
    add_common_args,
    evaluate,
    make_model,
    mean_over_seeds,
    prepare,
    run_variant,
)
from shared.runtime.config.keys import FIELDS  # noqa: E402

REPACK = {"repack_below": 0.25, "repack_min_tokens": 16, "longtail_workers": 1}
# name -> (mode, config keys beside the common ones); max_staleness comes from --max-staleness (0 for sync).
# "weights_port": "free" is replaced by a free loopback port when the variant starts (the trainer's weight server,
# the root of the relays' fetch tree)
VARIANTS = {
    "sync": ("sync", {}),
    "global": ("async", {}),
    "repack": ("async", REPACK),
    "rolling": (
        "async",
        {
            "sync_mode": "rolling",
            "max_loading": 2,
            "weights_port": "free",
            "relay_port": -1,
            "relay_fanout": 2,
            **REPACK,
        },
    ),
    "pull": (
        "async",
        {"sync_mode": "pull", "max_loading": 2, "weights_port": "free", "relay_port": -1, "relay_fanout": 2, **REPACK},
    ),
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def length_spread(max_tokens: int) -> tuple[int, int]:
    """(median, p99) of chain_sum's reference response lengths in tokens (tiny tokenizer: a character each, + EOS),
    capped at ``max_tokens``: the long tail the workers see once the warm start imitates the reference."""
    from services.driver.tasks import chain_sum, reference

    lengths = sorted(min(max_tokens, len("".join(t for t, _ in reference(r))) + 1) for r in chain_sum(20000, seed=1))
    return lengths[len(lengths) // 2], lengths[int(len(lengths) * 0.99)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--workers", type=int, default=8, help="rollout worker processes per run")
    p.add_argument("--max-staleness", type=int, default=2, help="of the async variants")
    p.add_argument(
        "--variants", default="sync,global,repack,rolling", help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    p.add_argument(
        "--weights-fetch",
        choices=("always", "auto"),
        default="always",
        help="always: every async variant's workers download each version over HTTP (the trainer's "
        "weight server, and relays where the variant has them), as on a cluster; auto: workers on "
        "the trainer's host read its file and the relays carry nothing",
    )
    p.add_argument(
        "--max-loading", type=int, default=0, help="max_loading of the rolling and pull variants (0: theirs, 2)"
    )
    p.add_argument(
        "--simulated-load-ms",
        type=float,
        default=0.0,
        help="simulated cost of one weight load in each worker (sleep; 0: none, the tiny model's own load)",
    )
    # the trainer's simulated cost is lower than async_vs_sync's 400 us: with 8 workers at 400 us the trainer is
    # busy 85 % under the global pause already (measured), which would hide whatever the rollout side gains
    p.set_defaults(simulate_gpu=True, in_flight=8, simulated_train_us_per_token=100.0)
    args = p.parse_args()
    prepare(args)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {', '.join(bad)}; expected some of {', '.join(VARIANTS)}")
    missing = sorted({k for n in names for k in VARIANTS[n][1] if k not in FIELDS})
    if missing:
        raise SystemExit(
            f"this tree's config has no key {', '.join(missing)}: the variants "
            f"{', '.join(n for n in names if set(VARIANTS[n][1]) & set(missing))} cannot run here"
        )
    per_version = args.group_size * args.batch_groups
    median, p99 = length_spread(args.max_tokens)
    print(
        f"trajectory-level asynchrony: chain_sum, {args.workers} rollout workers, budget "
        f"{args.versions * per_version} trained samples per variant ({args.versions} steps x {args.batch_groups} "
        f"groups x {args.group_size}), max_tokens {args.max_tokens} (reference lengths: median {median}, p99 {p99} "
        f"= {p99 / median:.1f}x), async max_staleness {args.max_staleness}, {args.seeds} seed(s), "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    print(
        f"SIMULATED COST (not measured hardware): every engine step sleeps {args.step_delay_ms:g} ms, the "
        f"trainer sleeps {args.simulated_train_us_per_token:g} us per trained token"
        + (f", every weight load sleeps {args.simulated_load_ms:g} ms" if args.simulated_load_ms else ""),
        flush=True,
    )
    if args.simulated_load_ms and "simulated_load_ms" not in FIELDS:
        raise SystemExit("this tree's config has no key simulated_load_ms: --simulated-load-ms cannot run here")
    print(
        "weights: "
        + (
            "downloaded over HTTP by every async variant"
            if args.weights_fetch == "always"
            else "read from the trainer folder (one host)"
        )
        + " "
        f"(--weights-fetch {args.weights_fetch})",
        flush=True,
    )
    tag = uuid.uuid4().hex[:6]
    model_dir = ROOT / "runs" / f"bench-{tag}-model"
    t0 = time.monotonic()
    make_model(model_dir, args.warm_steps)
    from services.driver.tasks import chain_sum

    args.eval_rows = chain_sum(args.eval_size, seed=777)
    print(
        f"greedy accuracy before RL on {args.eval_size} fixed problems: "
        f"{evaluate(model_dir, None, args.eval_rows, args.max_tokens):.3f}",
        flush=True,
    )
    runs = {n: [] for n in names}
    # interleaved: seed 0 of every variant, then seed 1...
    for seed in range(args.seeds):
        for n in names:
            mode, extra = VARIANTS[n]
            if mode == "async" and args.weights_fetch == "always":
                extra = {"weights_fetch": "always", "weights_port": "free", **extra}
            extra = {k: free_port() if v == "free" else v for k, v in extra.items()}
            if args.max_loading and "max_loading" in extra:
                extra["max_loading"] = args.max_loading
            staleness = 0 if mode == "sync" else args.max_staleness
            runs[n].append(
                run_variant(
                    args,
                    mode,
                    staleness,
                    model_dir,
                    tag,
                    seed,
                    extra={"rollout_workers": args.workers, **extra},
                    label=n,
                )
            )
    shutil.rmtree(model_dir, ignore_errors=True)
    results = {n: mean_over_seeds(rs) for n, rs in runs.items()}
    base = results.get("global") or next(iter(results.values()))
    sync = results.get("sync")
    print(
        f"\nresults: {args.workers} rollout workers; SIMULATED COST: {args.step_delay_ms:g} ms per engine step, "
        f"{args.simulated_train_us_per_token:g} us per trained token"
        + (f", {args.simulated_load_ms:g} ms per weight load" if args.simulated_load_ms else "")
    )
    print(
        f"{'variant':<9}{'samples':>8}{'seconds':>9}{'tok/s':>8}{'x global':>9}{'x sync':>8}{'gen tok/s':>10}"
        f"{'unused':>8}{'rollout busy':>13}{'train %':>8}{'eval':>7}{'- global':>9}{'sd':>7}{'repacks':>8}"
        f"{'tok moved':>10}"
    )
    for n, r in results.items():
        print(
            f"{n:<9}{r['samples']:>8}{r['seconds']:>9.1f}{r['tokens_per_s']:>8.0f}"
            f"{r['tokens_per_s'] / base['tokens_per_s']:>9.2f}"
            f"{(r['tokens_per_s'] / sync['tokens_per_s'] if sync else float('nan')):>8.2f}"
            f"{r['generated_tokens'] / r['seconds']:>10.0f}{1 - r['tokens'] / max(1, r['generated_tokens']):>8.1%}"
            f"{r['rollout_busy']:>13.0%}{r['train_s'] / r['seconds']:>8.0%}{r['final_eval']:>7.3f}"
            f"{r['final_eval'] - base['final_eval']:>+9.3f}{r['eval_sd']:>7.3f}{r.get('repacks', 0):>8.0f}"
            f"{r.get('repacked_tokens', 0):>10.0f}"
        )
    for n, r in results.items():
        # sync_mode pull: the workers' own counters, summed over them
        if r.get("pulled"):
            print(
                f"{n}: {r['pulled']:.0f} versions loaded by pull over the workers (from relays "
                f"{r.get('pulled_from_relay', 0):.0f}, the trainer {r.get('pulled_from_trainer', 0):.0f}, its file "
                f"read locally {r.get('pulled_local', 0):.0f}); mean publish to loaded "
                f"{r['pull_announced_s'] / r['pulled']:.3f}s, "
                f"mean pause per load {r['pull_paused_s'] / r['pulled']:.3f}s, "
                f"lease refusals {r.get('pull_lease_refused', 0):.0f}"
            )
    print(
        f"(tok/s: trained response tokens per second; unused: generated, never trained within the budget; "
        f"rollout busy: engine steps / wall, mean over workers; total {time.monotonic() - t0:.0f}s)"
    )
    if args.json:
        print(json.dumps({n: {k: v for k, v in r.items() if k != "curve"} for n, r in results.items()}, default=str))
    from bench.harness.record import record

    base_name = "global" if "global" in results else next(iter(results))
    record(
        "trajectory_async",
        [
            {
                "what": f"{n} over {base_name}, trained tokens/s, {args.workers} rollout workers, {args.seeds} seed(s)",
                "value": f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x ({r['tokens_per_s']:,.0f} vs "
                f"{base['tokens_per_s']:,.0f}); rollout busy {r['rollout_busy']:.0%} vs {base['rollout_busy']:.0%}",
            }
            for n, r in results.items()
            if n != base_name
        ],
        [
            "services",
            "shared",
            "bench/learning/trajectory_async.py",
            "bench/learning/async_vs_sync.py",
            "bench/harness/runs.py",
        ],
        simulated=f"every engine step sleeps {args.step_delay_ms:g} ms, the trainer "
        f"{args.simulated_train_us_per_token:g} us per trained token"
        + (f", every weight load {args.simulated_load_ms:g} ms" if args.simulated_load_ms else ""),
    )


if __name__ == "__main__":
    main()
