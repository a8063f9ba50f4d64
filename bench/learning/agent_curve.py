"""Does the agent example learn where a user can see it? `streamrl run --agent examples.calc:agent` as the README
runs it, several times, each in a scratch folder of its own (so each makes the default agent model, as a fresh
clone does), and per run: the 20-step mean reward at the start, the seconds from the first trainer step until the
20-step mean first reaches the target, the last 20 steps' mean, and the end-of-run check. One figure with every
run's curve.

    python bench/learning/agent_curve.py                 # 3 runs of 5 minutes, target 0.8
    python bench/learning/agent_curve.py --runs 1 --max-minutes 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness.record import RESULTS, record  # noqa: E402
from bench.harness.runs import streamrl_run  # noqa: E402

WINDOW = 20


def rolling(records: list[dict], window: int = WINDOW) -> list[tuple[float, int, float]]:
    """(seconds after the first step, version, mean reward of the last ``window`` steps) per trainer step from the
    ``window``-th on (pure)."""
    steps = [r for r in records if "reward_mean" in r and "time" in r]
    if not steps:
        return []
    t0 = steps[0]["time"]
    return [
        (
            steps[i]["time"] - t0,
            int(steps[i]["version"]),
            statistics.fmean(r["reward_mean"] for r in steps[i - window + 1 : i + 1]),
        )
        for i in range(window - 1, len(steps))
    ]


def first_at(curve: list[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    """(seconds, version) of the first point of ``curve`` at ``target`` or above; None when it never gets there."""
    return next(((t, v) for t, v, m in curve if m >= target), None)


def plot(curves: dict[str, list], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot([t for t, _, _ in curve], [m for _, _, m in curve], label=name)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds after the first trainer step")
    ax.set_ylabel(f"mean reward, last {WINDOW} steps")
    ax.set_ylim(0, 1.02)
    ax.set_title("examples/calc.py on the default tiny chat model, 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path.relative_to(ROOT)}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-minutes", type=float, default=5.0)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--agent", default="examples.calc:agent")
    args = p.parse_args()
    tag = uuid.uuid4().hex[:6]
    results, curves = [], {}
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="agent-curve-") as scratch:
            lines: list[str] = []
            flags = {
                "run": f"bench-{tag}-agent-{i}",
                "agent": args.agent,
                "max_minutes": args.max_minutes,
                "run_dir": str(Path(scratch) / "runs"),
                "log_level": "warning",
            }
            _, records = streamrl_run(flags, cwd=Path(scratch), on_line=lines.append)
        curve = rolling(records)
        hit = first_at(curve, args.target)
        rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
        res = {
            "start": curve[0][2] if curve else None,
            "first_step": rewards[0] if rewards else None,
            "reached_s": round(hit[0], 1) if hit else None,
            "reached_version": hit[1] if hit else None,
            "last": statistics.fmean(rewards[-WINDOW:]) if rewards else None,
            "steps": len(rewards),
            "check_ok": bool(lines) and lines[-1].strip() == "ok",
        }
        results.append(res)
        curves[f"run {i + 1}"] = curve
        when = "never" if hit is None else f"{hit[0]:.0f} s (version {hit[1]})"
        print(
            f"   run {i + 1}: first {WINDOW} steps {res['start']:.3f}; {args.target} at {when}; last {WINDOW} steps "
            f"{res['last']:.3f}; {res['steps']} steps; check {'ok' if res['check_ok'] else 'NOT ok'}",
            flush=True,
        )
    plot(curves, args.target, RESULTS / "agent_curve.png")
    within = sum(r["reached_s"] is not None and r["reached_s"] <= args.max_minutes * 60 for r in results)
    reach = ", ".join("never" if r["reached_s"] is None else f"{r['reached_s']:.0f}" for r in results)
    record(
        "agent_curve",
        [
            {
                "what": f"agent example (examples/calc.py, default tiny chat model): seconds from the first step to a "
                f"{WINDOW}-step mean reward of {args.target}, {args.runs} runs",
                "value": f"**{reach} s ({within} of {args.runs} within {args.max_minutes:g} min)**",
            },
            {
                "what": f"agent example: {WINDOW}-step mean reward, first {WINDOW} steps -> last {WINDOW} steps",
                "value": "**"
                + ", ".join(f"{r['start']:.2f} -> {r['last']:.2f}" for r in results if r["start"] is not None)
                + "**",
            },
        ],
        ["services", "shared", "examples/calc.py", "bench/learning/agent_curve.py", "bench/harness/runs.py"],
        extra={"runs": results, "curves": curves, "target": args.target},
    )
    return 0 if all(r["check_ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
