"""The default job with and without `--chaos`, side by side on one box: wall time, the last-100-step reward, the
end-of-run check, and the chaos summary (the goal chaos is held to: check all zero, reward within 0.05, time <= 1.5x).

    python bench/run/chaos.py [--every 5] [--seed 0] [--max-versions 1000] [--pairs 1]
    python bench/run/chaos.py --agent examples.calc:agent [--minutes 3] [--every 5]

Each pair runs `streamrl run` twice in fresh run folders (the default tiny model, made once), plain then
`--chaos EVERY`; nothing else should run on the box. Prints one line per run and the ratios, and records
(bench/results/chaos.json) the median wall-time ratio over the pairs and, per process kind, the median over the chaos
runs of each run's median time from a kill to the next version.

With ``--agent``: one agent run of ``--minutes`` under ``--chaos`` (the gateway and the agents workers are victims
too), then every agent episode's outcome from `streamrl episodes --json`: each must have finished, or failed with
a reason from the agent itself; none lost (still running once the run ended, beyond the groups the check counts
as in flight) and none failed by a kill.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one(root: Path, name: str, max_versions: int, chaos: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_") and k != "REDIS_URL"}
    args = [
        sys.executable,
        "-m",
        "services.ops.cli.main",
        "run",
        "--run",
        name,
        "--run-dir",
        str(root / "runs"),
        "--model-dir",
        str(root / "model"),
        "--max-versions",
        str(max_versions),
        "--max-minutes",
        "30",
        *chaos,
    ]
    t0 = time.monotonic()
    out = subprocess.run(args, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    log = out.stdout + out.stderr
    (root / f"{name}.log").write_text(log)
    rewards = [
        json.loads(line)["reward_mean"]
        for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
        if '"reward_mean"' in line
    ]
    summary = [
        line
        for line in log.splitlines()
        if line.startswith(("streamrl run: chaos:", "  restarts:", "  kill to the next", "  by process:"))
    ]
    return {
        "name": name,
        "rc": out.returncode,
        "seconds": seconds,
        "check_ok": "\nok\n" in log,
        "last100": sum(rewards[-100:]) / max(len(rewards[-100:]), 1),
        "steps": len(rewards),
        "regen": (re.findall(r"tokens generated again\s+(\S+)", log) or ["?"])[-1],
        "takeovers": (re.findall(r"takeovers after a crash\s+(\d+)", log) or ["?"])[-1],
        "summary": summary,
        "tail": "\n".join(
            line
            for line in log.splitlines()
            if "crashed" in line or "Traceback" in line or line.startswith("streamrl run:")
        )[-3000:]
        + f"\n(log: {root / name}.log)"
        if out.returncode
        else "",
    }


# a kill's words
KILLED = ("killed", "SIGKILL", "connection", "Connection", "gateway_stopping", "timed out")


def agent_run(root: Path, spec: str, minutes: float, every: float, seed: int) -> bool:
    """One agent run under chaos in the default model folder (remade for the agent's recipe if need be)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    cli = [sys.executable, "-m", "services.ops.cli.main"]
    where = ["--run", "agent-chaos", "--run-dir", str(root / "runs")]
    t0 = time.monotonic()
    out = subprocess.run(
        cli
        + [
            "run",
            *where,
            "--agent",
            spec,
            "--max-minutes",
            str(minutes),
            "--chaos",
            str(every),
            "--chaos-seed",
            str(seed),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - t0
    log = out.stdout + out.stderr
    (root / "agent-chaos.log").write_text(log)
    listed = subprocess.run(
        cli + ["episodes", *where, "--kind", "agent", "--json"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    rows = json.loads(listed.stdout or "[]")
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    reasons: dict[str, int] = {}
    for r in rows:
        if r["outcome"] == "failed":
            reasons[r["error"][:100]] = reasons.get(r["error"][:100], 0) + 1
    in_flight = int((re.findall(r"(\d+) in flight", log) or ["0"])[-1])
    by_kill = sum(n for why, n in reasons.items() if any(w in why for w in KILLED))
    unfinished = outcomes.get("running", 0) + outcomes.get("paused", 0)
    print(
        f"agent run: rc {out.returncode}, {seconds:.0f} s, {len(rows)} agent episodes: "
        + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
        + f"; check {'ok' if chr(10) + 'ok' + chr(10) in log else 'FAILED'}; groups in flight at the end {in_flight}"
    )
    for line in log.splitlines():
        if line.startswith(("streamrl run: chaos:", "  restarts:", "  kill to the next", "  by process:")):
            print("   ", line.removeprefix("streamrl run: "))
    for why, n in sorted(reasons.items(), key=lambda x: -x[1]):
        print(f"    failed x{n}: {why}")
    print(f"failed by a kill: {by_kill}; unfinished episodes: {unfinished} (log: {root / 'agent-chaos.log'})")
    return out.returncode == 0 and "\nok\n" in log and by_kill == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--every", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-versions", type=int, default=1000)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--agent", default="", metavar="SPEC", help="an agent run under chaos instead (module:function)")
    ap.add_argument("--minutes", type=float, default=3.0, help="--agent: the run's length")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    if args.agent:
        return 0 if agent_run(root, args.agent, args.minutes, args.every, args.seed) else 1
    subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "make-model", "--model-dir", str(root / "model")],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    ok, ratios, kinds = True, [], {}
    for i in range(args.pairs):
        plain = one(root, f"plain{i}", args.max_versions, [])
        chaotic = one(
            root, f"chaos{i}", args.max_versions, ["--chaos", str(args.every), "--chaos-seed", str(args.seed + i)]
        )
        for r in (plain, chaotic):
            print(
                f"{r['name']}: rc {r['rc']}, {r['seconds']:.0f} s, {r['steps']} steps, last-100 reward "
                f"{r['last100']:.3f}, check {'ok' if r['check_ok'] else 'FAILED'}, tokens generated again "
                f"{r['regen']}, takeovers {r['takeovers']}",
                flush=True,
            )
            for line in r["summary"]:
                print("   ", line.removeprefix("streamrl run: "))
            if r["tail"]:
                print(r["tail"])
        print(
            f"pair {i}: time chaos/plain {chaotic['seconds'] / plain['seconds']:.2f}x, reward difference "
            f"{chaotic['last100'] - plain['last100']:+.3f}",
            flush=True,
        )
        ok &= plain["check_ok"] and chaotic["check_ok"] and chaotic["rc"] == 0
        ratios.append(chaotic["seconds"] / plain["seconds"])
        for kind, median in by_process(chaotic["summary"]).items():
            kinds.setdefault(kind, []).append(median)
    if ok and args.pairs >= 3:
        record_pairs(args, ratios, kinds)
    return 0 if ok else 1


BY_PROCESS = re.compile(r"(\w+) median ([\d.]+) s")


def by_process(summary: list[str]) -> dict[str, float]:
    """{process kind: median seconds from a kill to the next version} from the chaos summary's "by process" line."""
    line = next((x for x in summary if x.strip().startswith("by process:")), "")
    return {kind: float(s) for kind, s in BY_PROCESS.findall(line)}


def record_pairs(args, ratios: list[float], kinds: dict[str, list[float]]) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.harness.record import record

    worst = max(kinds, key=lambda k: statistics.median(kinds[k]))
    per_kind = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in sorted(kinds.items()))
    record(
        "chaos",
        [
            {
                "what": f"--chaos {args.every:g} wall time / plain, median of {len(ratios)} interleaved pairs",
                "value": f"{statistics.median(ratios):.2f}x (pairs {', '.join(f'{r:.2f}' for r in ratios)})",
            },
            {
                "what": "kill to the next version, median per process kind over the chaos runs (s)",
                "value": f"worst {worst} {statistics.median(kinds[worst]):.1f} s; {per_kind}",
            },
        ],
        ["services", "shared"],
        extra={"ratios": ratios, "kill_to_next": kinds},
    )


if __name__ == "__main__":
    sys.exit(main())
