"""Agent throughput: 1, 8 and 32 concurrent agents, each making two LLM calls with a 1-second tool
call between them, in async vs sync mode, side by side in one run. Tools overlapping generation (and
training) is where asynchronous RL wins: in sync mode a batch's tools, generation and the trainer's step
take turns; in async mode the next groups' agents run while the trainer learns.

    python bench/run/agents.py [--concurrency 1 8 32] [--minutes 1.5] [--tool-s 1.0]

Each variant is a whole ``streamrl run --agent bench.run.agents:agent`` (embedded Redis, rollout worker, trainer,
syncer, gateway, one agents worker process running ``agent_concurrency`` agents at once in threads) on the
default tiny model made for agent runs (chat template with tools, warm-started on the calc episodes), on CPU.
Reported per variant, from the trainer's metrics: trained samples (= agent episodes) per second from the
driver's start to the last step, and the ratio async / sync at each concurrency. On a box without a GPU the
LLM calls cost CPU time the agents' threads and the trainer also want: the ratios, not the absolute figures,
are what carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness.runs import streamrl_run  # noqa: E402

# the agents worker inherits it from the bench
TOOL_S = float(os.environ.get("BENCH_AGENT_TOOL_S", "1.0"))


def agent(client, task: dict) -> dict:
    """Two LLM calls with a tool between them that takes TOOL_S seconds (a sandbox, a search, a judge)."""
    from examples.calc import TOOLS, calc

    messages = [{"role": "user", "content": task["prompt"]}]
    message = (
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=96).choices[0].message
    )
    messages.append(message.model_dump(exclude_none=True))
    time.sleep(TOOL_S)
    if message.tool_calls:
        call = message.tool_calls[0]
        try:
            expr = str(json.loads(call.function.arguments or "{}").get("e", ""))
        except ValueError:
            expr = ""
        messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(expr)})
    else:
        messages.append({"role": "user", "content": "Use the calc tool."})
    message = (
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=96).choices[0].message
    )
    numbers = re.findall(r"-?\d+", message.content or "")
    return float(bool(numbers) and numbers[-1] == str(task["answer"]))


def summarize(t_start: float, steps: list[dict]) -> dict:
    samples = sum(s["samples"] for s in steps)
    elapsed = steps[-1]["time"] - t_start if steps else float("nan")
    return {
        "steps": len(steps),
        "samples": samples,
        "seconds": elapsed,
        "samples_per_s": samples / elapsed,
        "trainer_wait_s": sum(s["wait_s"] for s in steps),
        "reward": sum(s["reward_mean"] for s in steps) / max(len(steps), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--minutes", type=float, default=1.5, help="max_minutes of each variant")
    p.add_argument("--tool-s", type=float, default=1.0, help="seconds the tool takes")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch-groups", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=400)
    p.add_argument(
        "--model-dir",
        help="an agent-format model to use instead of making one (e.g. models/tiny after "
        "`streamrl make-model --agent examples.calc:agent`)",
    )
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ["BENCH_AGENT_TOOL_S"] = str(args.tool_s)
    tag = uuid.uuid4().hex[:6]
    work = ROOT / "runs" / f"bench-agents-{tag}"
    model_dir = Path(args.model_dir).resolve() if args.model_dir else work / "model"
    from services.ops.launch.default_model import make_default_model

    t0 = time.monotonic()
    if not args.model_dir:
        make_default_model(model_dir, agent=True, warm_steps=args.warm_steps, seed=0)
    print(
        f"agents bench: {os.cpu_count()} CPUs, no GPU; tiny agent model made in {time.monotonic() - t0:.0f}s; "
        f"tool {args.tool_s}s; groups of {args.group_size}, {args.batch_groups} per step",
        flush=True,
    )
    results = []
    for n in args.concurrency:
        for mode in ("sync", "async"):
            flags = {
                "run": f"bench-agents-{tag}-{mode}-{n}",
                "run_dir": str(work),
                "model_dir": str(model_dir),
                "agent": "bench.run.agents:agent",
                "agent_workers": 1,
                "agent_concurrency": n,
                "mode": mode,
                "max_staleness": 0 if mode == "sync" else 1,
                "max_minutes": args.minutes,
                "group_size": args.group_size,
                "batch_groups": args.batch_groups,
                "val_every": 0,
                "log_level": "warning",
                "seed": 0,
            }
            t_start, steps = streamrl_run(flags, args.verbose)
            r = summarize(t_start, steps) | {"mode": mode, "concurrency": n}
            print(
                f"   {mode} x{n}: {r['samples']} samples in {r['seconds']:.0f}s = {r['samples_per_s']:.2f}/s "
                f"({r['steps']} steps, trainer waited {r['trainer_wait_s']:.0f}s)",
                flush=True,
            )
            results.append(r)
    shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'agents':>7}{'sync samples/s':>16}{'async samples/s':>17}{'async / sync':>14}")
    for n in args.concurrency:
        s, a = (next(r for r in results if r["concurrency"] == n and r["mode"] == m) for m in ("sync", "async"))
        print(
            f"{n:>7}{s['samples_per_s']:>16.2f}{a['samples_per_s']:>17.2f}"
            f"{a['samples_per_s'] / s['samples_per_s']:>14.2f}"
        )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
