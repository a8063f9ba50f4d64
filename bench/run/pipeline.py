"""The default run's pipeline speed: this checkout against an older revision, side by side on one box.

Each variant is the default job (`streamrl run`: embedded Redis, every Procfile process, the default tiny model
and task) stopped by ``--minutes``; the two trees run one after the other, interleaved (base, head, base, head...)
so a change in the box's load moves both alike. The base revision is checked out into a temporary git worktree
and run with the same Python environment (``PYTHONPATH`` set to its tree), on a copy of the same default model.

Reported per run, from the trainer's metrics file and the run's own Redis (its append-only data, read after the
run): trained samples/s (samples in trained batches / (last step - driver start)), versions/s, and busy
fractions of wall time: the trainer (its training steps and commits; "waiting" is its wait for samples) and the
rollout worker (its engine steps). Usage:

    python bench/run/pipeline.py --base d9afff1                 # 2 x 2 runs of 1.5 minutes (~7 min)
    python bench/run/pipeline.py --base d9afff1 --minutes 3 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness.runs import rollout_reports  # noqa: E402
from shared.protocol.streams import metrics  # noqa: E402


def run_once(tree: Path, run: str, minutes: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("STREAMRL_")}
    env.update(PYTHONPATH=str(tree), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    cmd = [sys.executable, "-m", "services.ops.cli.main", "run", "--run", run, "--max-minutes", str(minutes)]
    t_start = None
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "driver" in line and "started;" in line and t_start is None:
            t_start = time.time()
    if proc.wait() != 0 or t_start is None:
        raise SystemExit(f"{tree} {run}: streamrl run exited {proc.returncode}")
    steps = metrics.read_file(tree / "runs" / run / "metrics.jsonl")
    elapsed = steps[-1]["time"] - t_start
    last = rollout_reports(tree / "runs", run)
    rollout_busy = sum(r["busy_s"] for r in last.values()) / max(1, len(last))
    return {
        "samples_per_s": sum(s["samples"] for s in steps) / elapsed,
        "versions": steps[-1]["version"],
        "versions_per_s": steps[-1]["version"] / elapsed,
        "elapsed": elapsed,
        "trainer_busy": sum(s["train_s"] + s.get("commit_s", 0) for s in steps) / elapsed,
        "trainer_waiting": sum(s["wait_s"] for s in steps[1:]) / elapsed,
        "rollout_busy": rollout_busy / elapsed,
        "final_reward": sum(s["reward_mean"] for s in steps[-20:]) / len(steps[-20:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision to compare this checkout with")
    p.add_argument("--minutes", type=float, default=1.5, help="length of each run")
    p.add_argument("--repeats", type=int, default=2, help="runs per tree, interleaved")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="streamrl-base-"))
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base], cwd=ROOT, check=True)
    head_rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    try:
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from shared.runtime.config.keys import Config; "
                "from services.ops.launch.default_model import ensure_default_model; ensure_default_model(Config())",
            ],
            cwd=ROOT,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        # the same model for both
        shutil.copytree(ROOT / "models" / "tiny", base / "models" / "tiny")
        tag = uuid.uuid4().hex[:6]
        results: dict[str, list[dict]] = {"base": [], "head": []}
        for i in range(args.repeats):
            for name, tree in (("base", base), ("head", ROOT)):
                r = run_once(tree, f"pipe-{tag}-{name}{i}", args.minutes)
                results[name].append(r)
                print(
                    f"{name} ({args.base if name == 'base' else head_rev + ' + working tree'}) run {i + 1}: "
                    f"{r['samples_per_s']:.1f} samples/s, {r['versions']} versions, trainer busy "
                    f"{r['trainer_busy']:.0%} (waiting for samples {r['trainer_waiting']:.0%}), rollout busy "
                    f"{r['rollout_busy']:.0%}, last-20-step reward "
                    f"{r['final_reward']:.3f}",
                    flush=True,
                )
        mean = {n: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for n, rs in results.items()}
        print(
            f"\n{'tree':<6}{'samples/s':>11}{'versions/s':>12}{'trainer busy':>14}{'waiting':>9}{'rollout busy':>14}"
            f"{'reward':>8}"
        )
        for n, m in mean.items():
            print(
                f"{n:<6}{m['samples_per_s']:>11.1f}{m['versions_per_s']:>12.2f}{m['trainer_busy']:>14.0%}"
                f"{m['trainer_waiting']:>9.0%}{m['rollout_busy']:>14.0%}{m['final_reward']:>8.3f}"
            )
        print(
            f"head / base samples/s: {mean['head']['samples_per_s'] / mean['base']['samples_per_s']:.2f}x "
            f"(means of {args.repeats} interleaved {args.minutes:g}-minute runs each; {os.cpu_count()} CPUs)"
        )
        if args.json:
            print(json.dumps(results))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)


if __name__ == "__main__":
    main()
