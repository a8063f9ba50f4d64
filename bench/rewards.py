"""Rewards: the built-in arithmetic reward called in the worker vs the same reward as an rq job on the tools
queue (what every non-inline reward_fn costs per episode: enqueue, a tools worker runs it, the worker polls).

    python bench/rewards.py [--jobs 100]

Starts its own EmbeddedRedis and one `python -m services.rollout.jobs.tools_worker`; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from services.rollout import rewards  # noqa: E402
from services.rollout.jobs.tool_jobs import ToolJobs  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402

SPEC = "services.rollout.jobs.rewards:arithmetic"
RESPONSE, TASK = "<call>calc: 6*7</call><result>42</result>answer: 42", {"answer": "42"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=100)
    args = ap.parse_args(argv)
    reward = rewards.load(SPEC)
    n_inline = 20_000
    t0 = time.perf_counter()
    for _ in range(n_inline):
        reward(RESPONSE, TASK)
    inline_us = (time.perf_counter() - t0) / n_inline * 1e6
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis").start()
        keys = Keys("benchrewards")
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.rollout.jobs.tools_worker",
                "--run",
                keys.run,
                "--redis-url",
                server.url,
                "--log-level",
                "warning",
            ]
        )
        try:
            client = connect(server.url)
            jobs = ToolJobs(client, keys.tool_queue, keys.run, "", SPEC, 10.0, 10.0)
            # the tools worker's start-up is not measured
            jobs.reward("warmup", "", RESPONSE, TASK)
            while not jobs.poll():
                time.sleep(0.001)
            t0 = time.perf_counter()
            # one at a time: the latency an episode waits for its reward
            for i in range(args.jobs):
                jobs.reward(f"e{i}", "", RESPONSE, TASK)
                while not (out := jobs.poll()):
                    time.sleep(0.001)
                assert out[0].ok and out[0].value[0] == 1.0, out
            job_ms = (time.perf_counter() - t0) / args.jobs * 1e3
        finally:
            worker.terminate()
            worker.wait(10)
            server.stop()
    print(
        json.dumps(
            {
                "inline_us_per_reward": round(inline_us, 2),
                "rq_job_ms_per_reward": round(job_ms, 2),
                "ratio": round(job_ms * 1e3 / inline_us),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
