"""Would the staleness benchmark's recipe make a better default? The default job as a user runs it, side by side:
today's defaults against a candidate (default: the recipe that kept parity at η = 8 in bench/learning/staleness.py: lr
5e-5, token truncation, max_staleness 8), each seed interleaved, and the version at which each run's 20-step mean reward
first reaches 0.9 (the bar for changing a default: no later than today's).

    python bench/learning/defaults_reach.py --seeds 2
    python bench/learning/defaults_reach.py --candidate lr=1e-4,is_mode=truncate,max_staleness=4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.record import record  # noqa: E402
from bench.harness.runs import streamrl_run  # noqa: E402

RECIPE = "lr=5e-5,is_mode=truncate,max_staleness=8"


def reached(records: list[dict], target: float = 0.9, window: int = 20) -> int | None:
    """The version of the first trainer step whose mean reward over the last ``window`` steps is ``target`` or
    more (pure); None when the run never got there."""
    hit = reached_at(records, target, window)
    return hit[0] if hit else None


def reached_at(records: list[dict], target: float = 0.9, window: int = 20) -> tuple[int, float | None] | None:
    """(version, seconds after the first step) of the first trainer step whose mean reward over the last ``window``
    steps is ``target`` or more (pure; seconds None when the records carry no time); None when never."""
    steps = [r for r in records if "reward_mean" in r and "version" in r]
    for i in range(window - 1, len(steps)):
        if statistics.fmean(r["reward_mean"] for r in steps[i - window + 1 : i + 1]) >= target:
            t = steps[i].get("time"), steps[0].get("time")
            return int(steps[i]["version"]), (t[0] - t[1] if None not in t else None)
    return None


def parse_candidate(text: str) -> dict:
    """``key=value,key=value`` -> {key: value}; a part without '=' is an error naming it."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise SystemExit(f"--candidate: expected key=value parts separated by commas, got {part!r}")
        out[key.strip()] = value.strip()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--candidate", default=RECIPE, help=f"config keys the candidate changes (default {RECIPE})")
    p.add_argument("--max-versions", type=int, default=1000)
    args = p.parse_args()
    candidate = parse_candidate(args.candidate)
    tag = uuid.uuid4().hex[:6]
    reach: dict[str, list] = {"default": [], "candidate": []}
    seconds: dict[str, list] = {"default": [], "candidate": []}
    final: dict[str, list] = {"default": [], "candidate": []}
    for seed in range(args.seeds):
        for name, extra in (("default", {}), ("candidate", candidate)):
            flags = {
                "run": f"bench-{tag}-{name}-s{seed}",
                "seed": seed,
                "max_versions": args.max_versions,
                "log_level": "warning",
                **extra,
            }
            _, records = streamrl_run(flags)
            hit = reached_at(records)
            v = hit[0] if hit else None
            seconds[name].append(round(hit[1], 1) if hit and hit[1] is not None else None)
            rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
            reach[name].append(v)
            final[name].append(statistics.fmean(rewards[-20:]) if rewards else float("nan"))
            print(
                f"   {name} seed {seed}: 20-step mean reward 0.9 at version {v} ({seconds[name][-1]} s after the "
                f"first step); last 20 steps {final[name][-1]:.3f}",
                flush=True,
            )
    fmt = lambda vs: ", ".join("never" if v is None else str(v) for v in vs)  # noqa: E731
    fmt_s = lambda vs: ", ".join("never" if v is None else f"{v:.0f} s" for v in vs)  # noqa: E731
    print(f"\nversion at which the 20-step mean reward first reaches 0.9 (seeds 0..{args.seeds - 1}):")
    print(
        f"  seconds after the first step: default {fmt_s(seconds['default'])}; candidate {fmt_s(seconds['candidate'])}"
    )
    print(f"  default:   {fmt(reach['default'])}   (last 20 steps: {', '.join(f'{x:.3f}' for x in final['default'])})")
    print(
        f"  candidate {args.candidate}: {fmt(reach['candidate'])}   "
        f"(last 20 steps: {', '.join(f'{x:.3f}' for x in final['candidate'])})"
    )
    record(
        "defaults_reach",
        [
            {
                "what": f"default job, versions to a 20-step mean reward of 0.9, today's defaults vs {args.candidate} "
                f"({args.seeds} seeds, interleaved)",
                "value": f"**{fmt(reach['default'])} vs {fmt(reach['candidate'])}**",
            },
            {
                "what": f"default job, seconds from the first step to a 20-step mean reward of 0.9, defaults vs "
                f"{args.candidate}",
                "value": f"**{fmt_s(seconds['default'])} vs {fmt_s(seconds['candidate'])}**",
            },
        ],
        ["services", "shared", "bench/learning/defaults_reach.py", "bench/harness/runs.py"],
        extra={"reach": reach, "seconds": seconds, "final_reward": final, "candidate": candidate},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
