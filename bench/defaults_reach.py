"""Would the staleness benchmark's recipe make a better default? The default job as a user runs it, side by side:
today's defaults against a candidate (default: the recipe that kept parity at η = 8 in bench/staleness.py: lr 5e-5,
token truncation, max_staleness 8), each seed interleaved, and the version at which each run's 20-step mean
reward first reaches 0.9 (issue 32's bar for changing a default: no later than today's).

    python bench/defaults_reach.py --seeds 2
    python bench/defaults_reach.py --candidate lr=1e-4,is_mode=truncate,max_staleness=4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from bench.runs import streamrl_run  # noqa: E402

RECIPE = "lr=5e-5,is_mode=truncate,max_staleness=8"


def reached(records: list[dict], target: float = 0.9, window: int = 20) -> int | None:
    """The version of the first trainer step whose mean reward over the last ``window`` steps is ``target`` or
    more (pure); None when the run never got there."""
    steps = [r for r in records if "reward_mean" in r and "version" in r]
    for i in range(window - 1, len(steps)):
        if statistics.fmean(r["reward_mean"] for r in steps[i - window + 1 : i + 1]) >= target:
            return int(steps[i]["version"])
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
            v = reached(records)
            rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
            reach[name].append(v)
            final[name].append(statistics.fmean(rewards[-20:]) if rewards else float("nan"))
            print(
                f"   {name} seed {seed}: 20-step mean reward 0.9 at version {v}; last 20 steps {final[name][-1]:.3f}",
                flush=True,
            )
    fmt = lambda vs: ", ".join("never" if v is None else str(v) for v in vs)  # noqa: E731
    print(f"\nversion at which the 20-step mean reward first reaches 0.9 (seeds 0..{args.seeds - 1}):")
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
            }
        ],
        ["services", "shared", "bench/defaults_reach.py", "bench/runs.py"],
        extra={"reach": reach, "final_reward": final, "candidate": candidate},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
