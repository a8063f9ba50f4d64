"""Asynchronous vs synchronous RL, side by side in one run: the same task, model and sample budget under
``mode=sync`` (``max_staleness=0``: generate a batch with version v, train, publish v+1, sync, repeat) and
``mode=async`` with ``max_staleness`` 1 and 2. Each variant is a whole ``streamrl run`` (embedded Redis and
every Procfile process) on a fresh run namespace.

The task is ``chain_sum`` (``services/driver/tasks.py``): sums of 2..24 one-digit numbers whose reference response
writes every running sum, with a long-tailed number of terms, so response lengths are long-tailed (median
~2 tokens, a few percent 40+). The model is the default tiny Llama warm-started on that task once, shared by
every variant (each run reads it and publishes its own versions).

Reported per variant, from the trainer's metrics file and the driver's output:
  trained samples/s  samples in trained batches / (last step - driver start), startup excluded
  time to target     seconds from driver start until the mean reward of the last ``--window`` steps
                     reaches the target (the same target for all variants)
  final reward       mean training reward over the last 20% of trained samples
  eval               greedy accuracy of the last version of the budget on 200 fixed chain_sum problems (the
                     same for every variant; the training reward is measured on different samples)
  tokens/s           trained (response) tokens per second: async trains shorter responses on average
                     when long groups are lost, so samples/s flatters it; tokens/s does not. 'dropped': groups
                     not trained (no finished episode); 'wasted tok': finished tokens not trained (greedy,
                     past hard_max_staleness, over the IS cap, in dropped groups); stale groups train with
                     their importance weights
  gen tok/s          tokens the rollout workers generated per second (their own counters)
  unused             1 - trained tokens / generated tokens: work never trained within the budget, including
                     groups still in flight when the run ended ((max_staleness + 1) batches at most)
  train %            the trainer's training time / the variant's wall time
and the ratios async/sync. With ``--simulate-gpu`` every engine step and every trained token also cost a fixed
sleep (SIMULATED_GPU below): a stand-in for a memory-bound GPU decode step and GPU training time, named as
such in the output. Usage:

    python bench/learning/async_vs_sync.py                 # ~4-8 min on a 2-core CPU box
    python bench/learning/async_vs_sync.py --quick         # ~2 min smoke run, smaller budget
    python bench/learning/async_vs_sync.py --simulate-gpu  # the simulated GPU cost model (sleeps, named in the output)
    python bench/learning/async_vs_sync.py --seeds 3       # each variant 3 times (seeds 0, 1, 2), interleaved; figures
                                                  # are means, eval also with its spread over seeds

Every variant syncs weights every ``--steps-per-version`` (default 1) optimizer steps, so a version is one
optimizer step everywhere and ``max_staleness`` counts steps. Each variant runs alone, one after the other, on
the same machine; with several seeds the variants are interleaved (seed 0 of each, then seed 1 of each...), so
a change in the box's load moves every variant alike (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness.runs import rollout_reports, streamrl_run  # noqa: E402
from shared.runtime import runstate  # noqa: E402
from shared.runtime.config.keys import FIELDS, Config  # noqa: E402

VARIANTS = [("sync", 0), ("async", 1), ("async", 2)]
# --simulate-gpu: a named cost model standing in for a GPU on this CPU box (printed with every result). A
# memory-bound decode step costs about the same whatever the batch, so each engine step sleeps a fixed time; the
# trainer sleeps per trained token (compute-bound), tuned so that synchronous training is 20-40% of a version.
SIMULATED_GPU = {"step_delay_ms": 20.0, "simulated_train_us_per_token": 400.0}


def make_model(path: Path, warm_steps: int) -> float:
    from services.driver.tasks import chain_sum
    from services.ops.launch.default_model import greedy_accuracy, make_default_model

    t0 = time.monotonic()
    make_default_model(path, dataset="chain_sum", warm_steps=warm_steps, seed=0)
    print(
        f"model: tiny Llama + {warm_steps} warm-start steps on chain_sum in {time.monotonic() - t0:.0f}s; "
        f"greedy accuracy {greedy_accuracy(path, chain_sum(100, seed=777), max_tokens=80):.2f} on 100 problems",
        flush=True,
    )
    return time.monotonic() - t0


def evaluate(model_dir: Path, weights: Path | None, rows: list[dict], max_tokens: int) -> float:
    """Greedy accuracy of ``model_dir`` (with ``weights`` swapped in) on ``rows``: the same problems for every
    variant, unlike the training reward, which is measured on whatever each variant happened to train."""
    from services.ops.launch.default_model import greedy_accuracy

    if weights is None:
        return greedy_accuracy(model_dir, rows, max_tokens=max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        for f in model_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, tmp)
        shutil.copy(weights, Path(tmp) / "model.safetensors")
        return greedy_accuracy(tmp, rows, max_tokens=max_tokens)


def run_variant(
    args,
    mode: str,
    staleness: int,
    model_dir: Path,
    tag: str,
    seed: int = 0,
    extra: dict | None = None,
    label: str = "",
) -> dict:
    """One whole run of a variant; ``extra``: more config keys (bench/learning/trajectory_async.py's sync modes)."""
    run = f"bench-{tag}-{label or mode + str(staleness)}-s{seed}"
    per_version = args.steps_per_version
    flags = {
        "run": run,
        "mode": mode,
        "max_staleness": staleness,
        "dataset": "chain_sum",
        "model_dir": str(model_dir),
        "max_minutes": args.max_minutes,
        "max_versions": args.versions // per_version,
        "group_size": args.group_size,
        "batch_groups": args.batch_groups,
        "max_tokens": args.max_tokens,
        "max_groups_in_flight": args.in_flight,
        "max_batch_size": args.group_size * args.in_flight,
        "lr": args.lr,
        "tools": "",
        "log_level": "warning",
        "seed": seed,
        "steps_per_version": per_version,
        "hard_max_staleness": args.hard_max_staleness,
        "step_delay_ms": args.step_delay_ms,
        "simulated_train_us_per_token": args.simulated_train_us_per_token,
    }
    # bench/learning/trajectory_async.py's flag
    if getattr(args, "simulated_load_ms", 0):
        flags["simulated_load_ms"] = args.simulated_load_ms
    if "val_every" in FIELDS:
        # validation rounds would cost both modes the same rollout time; leave them out
        flags["val_every"] = 0
    flags.update(extra or {})
    print(f"\n== {label or mode} max_staleness={staleness} seed {seed}", flush=True)
    t_start, steps = streamrl_run(flags, args.verbose)
    reports = rollout_reports(Path(flags.get("run_dir", ROOT / "runs")), run)
    generated = sum(int(r.get("tokens", 0)) for r in reports.values())
    versions = args.versions // per_version
    # the budget; steps after the end don't count
    steps = [s for s in steps if s["step"] <= versions * per_version]
    # the default weights folder is keyed by the run's id
    run_path = Path(flags.get("run_dir", ROOT / "runs")) / run
    weights = Config(run=run, run_dir=str(run_path.parent), run_id=runstate.read_marker(run_path)["id"]).weights_path
    t0 = time.monotonic()
    # the trainer goes on for a step or few while the run shuts down and prunes old files: the first kept
    # version at or past the budget (printed; at most a few steps past it)
    kept = sorted(p for p in weights.glob("v*.safetensors") if int(p.stem[1:]) >= versions)
    if not kept:
        raise SystemExit(f"{run}: no published weights at or past version {versions} in {weights}")
    eval_version = int(kept[0].stem[1:])
    final_eval = evaluate(model_dir, kept[0], args.eval_rows, args.max_tokens)
    print(
        f"   greedy accuracy of version {eval_version} on {len(args.eval_rows)} fixed problems: {final_eval:.3f} "
        f"({time.monotonic() - t0:.0f}s)",
        flush=True,
    )
    shutil.rmtree(weights, ignore_errors=True)
    busy = [r["busy_s"] / max(1e-9, r["busy_s"] + r["idle_s"]) for r in reports.values()]
    counters = {
        k: sum(float(r.get(k, 0)) for r in reports.values())
        for k in {k for r in reports.values() for k in r if k.startswith(("repack", "pull"))}
    }
    return summarize(steps, t_start, args.window) | {
        "run": run,
        "mode": mode,
        "max_staleness": staleness,
        "final_eval": final_eval,
        "eval_version": eval_version,
        "seed": seed,
        "generated_tokens": generated,
        "rollout_busy": sum(busy) / max(1, len(busy)),
        "label": label or mode,
        **counters,
    }


def mean_over_seeds(runs: list[dict]) -> dict:
    """One row per variant: every number the mean over its seeds; eval also with its spread (sd over seeds)."""
    if len(runs) == 1:
        return runs[0] | {"eval_sd": 0.0, "seeds": 1}
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("max_staleness", "seed"):
            out[key] = sum(r[key] for r in runs) / len(runs)
    out["staleness_tokens"] = {
        k: round(sum(r["staleness_tokens"].get(k, 0) for r in runs) / len(runs))
        for k in {k for r in runs for k in r["staleness_tokens"]}
    }
    evals = [r["final_eval"] for r in runs]
    out["eval_sd"] = (sum((e - out["final_eval"]) ** 2 for e in evals) / (len(evals) - 1)) ** 0.5
    out["evals"], out["seeds"] = evals, len(runs)
    for key in ("samples", "stale_dropped", "tokens_wasted"):
        out[key] = round(out[key])
    return out


def summarize(steps: list[dict], t_start: float, window: int) -> dict:
    samples = sum(s["samples"] for s in steps)
    elapsed = steps[-1]["time"] - t_start
    rewards = [s["reward_mean"] for s in steps]
    curve = [
        (
            s["time"] - t_start,
            sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]),
        )
        for i, s in enumerate(steps)
    ]
    tail = steps[int(len(steps) * 0.8) :]
    final = sum(s["reward_mean"] * s["samples"] for s in tail) / sum(s["samples"] for s in tail)
    first = steps[: max(1, len(steps) // 10)]
    start = sum(s["reward_mean"] * s["samples"] for s in first) / sum(s["samples"] for s in first)
    stale = {}
    for s in steps:
        for k, v in s["staleness"].items():
            stale[k] = stale.get(k, 0) + v
    tokens = sum(s["tokens"] for s in steps)
    return {
        "steps": len(steps),
        "samples": samples,
        "seconds": elapsed,
        "samples_per_s": samples / elapsed,
        "train_s": sum(s["train_s"] for s in steps),
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "start_reward": start,
        "final_reward": final,
        "curve": curve,
        "response_len": sum(s["response_len"] for s in steps) / len(steps),
        "trainer_wait_s": sum(s["wait_s"] for s in steps),
        "staleness_tokens": stale,
        "stale_dropped": steps[-1].get("stale_dropped", 0),
        "tokens_wasted": steps[-1].get("tokens_wasted", 0),
    }


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, r in curve if r >= target), None)


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The flags every whole-run benchmark of async RL shares (this one and bench/learning/trajectory_async.py)."""
    p.add_argument("--quick", action="store_true", help="smaller sample budget, for a smoke run (~3 min)")
    p.add_argument("--budget", type=int, default=None, help="trained samples per variant (default 12288; quick 3072)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=32, help="max_groups_in_flight of the rollout worker")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warm-steps", type=int, default=400)
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="reward target for time-to-target (default: 0.95 x the lowest final reward of the variants)",
    )
    p.add_argument("--window", type=int, default=10, help="steps in the moving mean used for time-to-target")
    p.add_argument("--max-minutes", type=float, default=8.0, help="cap per variant")
    p.add_argument("--eval-size", type=int, default=200, help="fixed problems for the greedy evaluation")
    p.add_argument(
        "--steps-per-version",
        type=int,
        default=1,
        help="optimizer steps between weight syncs, the same for every variant",
    )
    p.add_argument(
        "--hard-max-staleness",
        type=int,
        default=0,
        help="policy tokens more versions behind than this are masked out (0: none)",
    )
    p.add_argument("--seeds", type=int, default=1, help="runs per variant (seeds 0..N-1, interleaved); means")
    p.add_argument(
        "--simulate-gpu",
        action="store_true",
        help=f"the simulated GPU cost model: {SIMULATED_GPU} (sleeps; named in the output)",
    )
    p.add_argument("--step-delay-ms", type=float, default=0.0, help="simulated cost of one engine step (sleep)")
    p.add_argument(
        "--simulated-train-us-per-token",
        type=float,
        default=0.0,
        help="simulated training cost per trained token (sleep)",
    )
    p.add_argument("--verbose", action="store_true", help="echo the driver's progress lines")
    p.add_argument("--json", action="store_true", help="print every figure as JSON at the end")


def prepare(args) -> None:
    """Defaults that depend on other flags: the simulated GPU's costs, the budget in versions."""
    if args.simulate_gpu:
        args.step_delay_ms = args.step_delay_ms or SIMULATED_GPU["step_delay_ms"]
        args.simulated_train_us_per_token = (
            args.simulated_train_us_per_token or SIMULATED_GPU["simulated_train_us_per_token"]
        )
    budget = args.budget or (3072 if args.quick else 12288)
    per_version = args.group_size * args.batch_groups
    args.versions = max(2, budget // per_version)


def stale_counts(st: dict) -> str:
    """Trained tokens by staleness, as 0/1/2/3+ (keys are staleness as strings)."""
    three_plus = sum(v for k, v in st.items() if int(k) >= 3)
    return "/".join(str(st.get(k, 0)) for k in ("0", "1", "2")) + f"/{three_plus}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    args = p.parse_args()
    prepare(args)
    per_version = args.group_size * args.batch_groups
    tag = uuid.uuid4().hex[:6]
    model_dir = ROOT / "runs" / f"bench-{tag}-model"
    t0 = time.monotonic()
    print(
        f"async vs sync: chain_sum, budget {args.versions * per_version} trained samples per variant "
        f"({args.versions} steps x {args.batch_groups} groups x {args.group_size}), max_tokens {args.max_tokens}, "
        f"lr {args.lr}, {args.steps_per_version} step(s) per version, hard_max_staleness {args.hard_max_staleness}, "
        f"{args.seeds} seed(s), {os.cpu_count()} CPUs",
        flush=True,
    )
    if args.step_delay_ms or args.simulated_train_us_per_token:
        print(
            f"SIMULATED COST (not measured hardware): every engine step sleeps {args.step_delay_ms:g} ms, the "
            f"trainer sleeps {args.simulated_train_us_per_token:g} us per trained token",
            flush=True,
        )
    make_model(model_dir, args.warm_steps)
    from services.driver.tasks import chain_sum

    args.eval_rows = chain_sum(args.eval_size, seed=777)
    start_eval = evaluate(model_dir, None, args.eval_rows, args.max_tokens)
    print(f"greedy accuracy before RL on {args.eval_size} fixed problems: {start_eval:.3f}", flush=True)
    runs = {(mode, eta): [] for mode, eta in VARIANTS}
    # interleaved: seed 0 of every variant, then seed 1 of every variant...
    for seed in range(args.seeds):
        for mode, eta in VARIANTS:
            runs[(mode, eta)].append(run_variant(args, mode, eta, model_dir, tag, seed))
    results = [mean_over_seeds(rs) for rs in runs.values()]
    shutil.rmtree(model_dir, ignore_errors=True)
    target = args.target if args.target is not None else 0.95 * min(r["final_reward"] for r in results)
    sync = results[0]
    sync_ttt = time_to(sync["curve"], target)
    print(
        f"\nresults (target reward {target:.3f}{'' if args.target is not None else ' = 0.95 x lowest final'}; "
        f"moving mean over {args.window} steps)"
    )
    print(
        f"{'variant':<22}{'samples':>8}{'seconds':>9}{'samples/s':>11}{'x sync':>8}{'to target s':>13}{'x sync':>8}"
        f"{'start r':>9}{'final r':>9}{'- sync':>8}{'eval':>7}{'- sync':>8}{'sd':>7}{'resp len':>9}{'tok/s':>8}"
        f"{'x sync':>7}{'dropped':>8}"
        f"{'wasted tok':>11}{'gen tok/s':>10}{'unused':>8}{'train %':>8} {'stale tok 0/1/2/3+':>26}"
    )
    for r in results:
        ttt = time_to(r["curve"], target)
        st = r["staleness_tokens"]
        speed = sync_ttt / ttt if ttt and sync_ttt else float("nan")
        print(
            f"{r['mode'] + ' max_staleness=' + str(r['max_staleness']):<22}{r['samples']:>8}{r['seconds']:>9.1f}"
            f"{r['samples_per_s']:>11.1f}{r['samples_per_s'] / sync['samples_per_s']:>8.2f}"
            f"{(f'{ttt:.1f}' if ttt is not None else 'never'):>13}{speed:>8.2f}"
            f"{r['start_reward']:>9.3f}{r['final_reward']:>9.3f}{r['final_reward'] - sync['final_reward']:>+8.3f}"
            f"{r['final_eval']:>7.3f}{r['final_eval'] - sync['final_eval']:>+8.3f}{r['eval_sd']:>7.3f}"
            f"{r['response_len']:>9.1f}{r['tokens_per_s']:>8.0f}{r['tokens_per_s'] / sync['tokens_per_s']:>7.2f}"
            f"{r['stale_dropped']:>8}{r['tokens_wasted']:>11}{r['generated_tokens'] / r['seconds']:>10.0f}"
            f"{1 - r['tokens'] / max(1, r['generated_tokens']):>8.1%}{r['train_s'] / r['seconds']:>8.0%}"
            f" {stale_counts(st):>26}"
        )
    print(
        f"(x sync of 'to target' is sync's time / this variant's time: > 1 is faster; sd: eval's standard deviation "
        f"over {args.seeds} seed(s); total {time.monotonic() - t0:.0f}s)"
    )
    if args.json:
        print(json.dumps({"target": target, "start_eval": start_eval, "results": results}, default=str))
    from bench.harness.record import record

    record(
        "async_vs_sync",
        [
            {
                "what": f"async (max_staleness {r['max_staleness']}) over sync, trained tokens/s on chain_sum, "
                f"{args.seeds} seed(s)",
                "value": f"{r['tokens_per_s'] / sync['tokens_per_s']:.2f}x ({r['tokens_per_s']:,.0f} vs "
                f"{sync['tokens_per_s']:,.0f}); greedy eval {r['final_eval'] - sync['final_eval']:+.3f} vs sync",
            }
            for r in results[1:]
        ],
        ["services", "shared", "bench/learning/async_vs_sync.py", "bench/harness/runs.py"],
        quick=args.quick,
        simulated=(
            f"every engine step sleeps {args.step_delay_ms:g} ms, the trainer {args.simulated_train_us_per_token:g}"
            f" us per trained token"
            if args.step_delay_ms or args.simulated_train_us_per_token
            else ""
        ),
    )


if __name__ == "__main__":
    main()
