"""The default job before and after a change, as a user runs it: samples/s, versions/s, the trainer's busy share and
the time to a 20-step mean reward of 0.9, in interleaved pairs (each pair alternates which runs first).

    python bench/trainer/default_ab.py [--before REV] [--pairs 2]

Each variant is one whole ``streamrl run`` with the defaults (the tiny model, the arithmetic task, to version 1000 or 10
minutes), of a git tree: "before" a worktree at ``--before``, "after" this tree (bench/harness/runs.py). Rates are over
the trainer's records: samples trained over the seconds from its first step to its last; the trainer's busy share is
its training and commit time over that plus its wait for samples, from its 21st step on (the first ones wait for the
rollout's start).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness.record import record  # noqa: E402
from bench.harness.runs import streamrl_run  # noqa: E402
from bench.learning.defaults_reach import reached  # noqa: E402


def rates(records: list[dict]) -> dict:
    steps = [r for r in records if "samples" in r and "time" in r]
    span = max(steps[-1]["time"] - steps[0]["time"], 1e-9)
    reach = reached(records)
    at = next((r["time"] for r in steps if r["version"] == reach), None) if reach is not None else None
    later = steps[20:] or steps
    working = sum(r.get("train_s", 0.0) + r.get("commit_s", 0.0) for r in later)
    waiting = sum(r.get("wait_s", 0.0) for r in later)
    return {
        "busy": working / max(working + waiting, 1e-9),
        "samples_per_s": sum(r["samples"] for r in steps[1:]) / span,
        "versions_per_s": (steps[-1]["version"] - steps[0]["version"]) / span,
        "versions": steps[-1]["version"],
        "reach_version": reach,
        "reach_s": at - steps[0]["time"] if at is not None else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="530f98d")
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    tag = uuid.uuid4().hex[:6]
    out: dict[str, list] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="streamrl-ab-") as tmp_name:
        tmp = Path(tmp_name)
        before = tmp / "before-tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True)
        # the default model, made once
        (before / "models").symlink_to(ROOT / "models")
        trees = {"before": before, "after": ROOT}
        try:
            for pair in range(args.pairs):
                for label in ("before", "after") if pair % 2 == 0 else ("after", "before"):
                    flags = {"run": f"ab-{tag}-{label}-{pair}", "run_dir": str(tmp / "runs")}
                    _, records = streamrl_run(flags, root=trees[label])
                    out[label].append(rates(records))
                    print(f"   {label}: {out[label][-1]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
    lines = [
        "| variant | samples/s (each run) | versions/s | trainer busy | 20-step mean 0.9 at (s / version) |",
        "|---|---|---|---|---|",
    ]
    med, busy = {}, {}
    for label, runs in out.items():
        med[label] = statistics.median(r["samples_per_s"] for r in runs)
        busy[label] = statistics.median(r["busy"] for r in runs)
        reach = ", ".join(f"{r['reach_s']:.0f} s / v{r['reach_version']}" if r["reach_s"] else "never" for r in runs)
        per_s = ", ".join("%.1f" % r["samples_per_s"] for r in runs)
        versions = ", ".join("%.2f" % r["versions_per_s"] for r in runs)
        busy_each = ", ".join(f"{r['busy']:.1%}" for r in runs)
        lines.append(f"| {label} | {per_s} | {versions} | {busy_each} | {reach} |")
    print("\n".join(lines) + f"\n(load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}; 2 cores)")
    ratio = med["after"] / med["before"]
    record(
        "default_ab",
        [
            {"what": "default run samples/s after / before the change (median of pairs)", "value": f"{ratio:.3f}x"},
            {
                "what": "the trainer's busy share of the default run, after and before (medians)",
                "value": f"{busy['after']:.1%} after, {busy['before']:.1%} before",
            },
        ],
        ["services", "shared"],
        extra={"before": args.before, "runs": out},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
