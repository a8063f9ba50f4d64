"""The agent-framework matrix: each stock agent (framework x API x streamed) trained with ``streamrl run --agent``
for a few minutes on the default tiny model. For each: episodes finished and failed (the most common error), the
versions trained, and the end-of-run check's verdict. Run one after another on a quiet box:

    python bench/agents/frameworks.py [--minutes 2] [--only langgraph,anthropic]

Writes bench/results/agents_frameworks.json (bench/harness/record.py) and prints the matrix as a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# (name, framework, API, streamed, agent spec)
MATRIX = [
    ("openai", "openai", "chat completions", False, "examples.calc:agent"),
    ("openai-stream", "openai", "chat completions", True, "examples.calc:stream_agent"),
    ("agents-sdk", "openai-agents", "Responses", False, "examples.calc_agents_sdk:agent"),
    ("agents-sdk-stream", "openai-agents", "Responses", True, "examples.calc_agents_sdk:stream_agent"),
    ("anthropic", "anthropic", "Messages", False, "examples.calc_anthropic:agent"),
    ("anthropic-stream", "anthropic", "Messages", True, "examples.calc_anthropic:stream_agent"),
    (
        "langgraph",
        "langchain-openai + langgraph",
        "chat completions",
        False,
        "tests.support.framework_agents:langgraph_agent",
    ),
    ("pydantic-ai", "pydantic-ai", "chat completions", False, "tests.support.framework_agents:pydantic_ai_agent"),
    ("litellm", "litellm", "chat completions", False, "tests.support.framework_agents:litellm_agent"),
]


def agent_records(run_dir: Path, run: str) -> list[dict]:
    """The run's 'agent' metrics records (one per ended episode), read from its own Redis data."""
    from services.ops.launch.redis_server import EmbeddedRedis
    from shared.protocol.keys import Keys
    from shared.protocol.streams import metrics
    from shared.runtime.connection import connect

    server = EmbeddedRedis(run_dir / run / "redis").start()
    try:
        return metrics.history(connect(server.url), Keys(run), run_dir / run, ("agent",))["agent"]
    finally:
        server.stop()


def one(name: str, spec: str, minutes: float, run_dir: Path) -> dict:
    run = f"fw-{name}"
    cmd = [sys.executable, "-m", "services.ops.cli.main", "run", "--agent", spec, "--run", run]
    cmd += ["--run-dir", str(run_dir), "--max-minutes", str(minutes)]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("STREAMRL_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    print(f"\n== {name}: {spec}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    lines = out.splitlines()
    at = next((i for i, x in enumerate(lines) if "streamrl check at the end of the run" in x), None)
    check = lines[at + 1 :] if at is not None else []
    verdict = next((x.strip() for x in check if x.strip().startswith(("ok", "FAIL", "check"))), "")
    verdict = verdict or (check[-1].strip() if check else f"no check (exit {proc.returncode})")
    try:
        records = agent_records(run_dir, run)
    except Exception as exc:
        records = []
        print(f"   could not read the run's agent records: {exc}")
    statuses = collections.Counter(r.get("status") for r in records)
    # the mean reward of the first and the last fifth of the ended episodes
    fifth = max(1, len(records) // 5)
    rewards = [
        round(sum(r.get("reward") or 0 for r in part) / len(part), 3) for part in (records[:fifth], records[-fifth:])
    ]
    errors = collections.Counter()
    versions = 0
    metrics_file = run_dir / run / "metrics.jsonl"
    if metrics_file.exists():
        for line in metrics_file.read_text().splitlines():
            versions = max(versions, int(json.loads(line).get("version") or 0))
    for x in lines:
        if "agent episode failed" in x and "error=" in x:
            errors[x.split("error=", 1)[1][:100]] += 1
    row = {
        "name": name,
        "spec": spec,
        "exit": proc.returncode,
        "seconds": round(time.time() - t0, 1),
        "finished": statuses.get("finished", 0),
        "failed": statuses.get("failed", 0),
        "statuses": dict(statuses),
        "top_error": errors.most_common(1)[0][0] if errors else "",
        "versions": versions,
        "reward_first_last_fifth": rewards if records else None,
        "check": verdict,
        "tail": lines[-30:],
    }
    print(f"   exit {row['exit']}, finished {row['finished']}, failed {row['failed']}, v{versions}, {verdict}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--only", default="", help="comma-separated names from the matrix")
    ap.add_argument("--run-dir", default=str(ROOT / "runs"))
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    rows = []
    for name, framework, api, streamed, spec in MATRIX:
        if only and name not in only:
            continue
        rows.append(
            {
                "framework": framework,
                "api": api,
                "streamed": streamed,
                **one(name, spec, args.minutes, Path(args.run_dir)),
            }
        )
    from bench.harness.record import RESULTS, record

    old = RESULTS / "agents_frameworks.json"
    kept = json.loads(old.read_text()).get("extra", {}).get("matrix", []) if old.exists() else []
    # a partial run (--only) replaces its rows and keeps the others
    kept = [r for r in kept if r["name"] not in {x["name"] for x in rows}]
    matrix = [r for name, *_ in MATRIX for r in kept + rows if r["name"] == name]
    trained = [r for r in matrix if r["versions"] > 0 and r["check"].startswith("ok")]
    failed, ended = sum(r["failed"] for r in matrix), sum(r["finished"] + r["failed"] for r in matrix)
    record(
        "agents_frameworks",
        [
            {
                "what": f"stock agents trained with streamrl run --agent, {args.minutes:g} min each",
                "value": f"{len(trained)} of {len(matrix)} trained, check ok; {failed} of {ended:,} episodes failed",
            }
        ],
        ["services/gateway", "services/rollout/calls", "examples", "tests/support/framework_agents.py"],
        extra={"minutes": args.minutes, "matrix": matrix},
    )
    print(
        "\n| framework | API | streamed | episodes finished | failed | versions | reward (first / last fifth) | check |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in matrix:
        print(
            f"| {r['framework']} | {r['api']} | {'yes' if r['streamed'] else 'no'} | {r['finished']:,} | "
            f"{r['failed']:,} | {r['versions']} | {' / '.join(map(str, r.get('reward_first_last_fifth') or []))} | "
            f"{r['check']} |"
        )


if __name__ == "__main__":
    main()
