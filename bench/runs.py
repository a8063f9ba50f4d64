"""One whole `streamrl run` as a benchmark variant: embedded Redis and every Procfile process on a fresh run
namespace, started by the CLI as a user would; returns when the run has ended, with the trainer's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def streamrl_run(flags: dict, verbose: bool = False) -> tuple[float, list[dict]]:
    """Run ``streamrl run`` with ``flags`` (config keys -> values); (wall time the driver started, the trainer's
    metrics records). Raises SystemExit naming the run when it fails or never starts."""
    cmd = [sys.executable, "-m", "services.ops.cli", "run"]
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("STREAMRL_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the Procfile's python, streamrl
    print(f"\n== {' '.join(cmd[4:])}", flush=True)
    t_start, last_line = None, ""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "driver" in line and "started;" in line and t_start is None:
            t_start = time.time()
        if "driver" in line and ("[" in line or "ending the run" in line or "up at version" in line):
            last_line = line.rstrip()
            if verbose or "ending" in line or "up at" in line:
                print("   " + last_line, flush=True)
    rc = proc.wait()
    if rc != 0 or t_start is None:
        raise SystemExit(f"{flags['run']}: streamrl run exited {rc} (driver started: {t_start is not None}); "
                         f"last: {last_line}")
    run_dir = Path(flags.get("run_dir", ROOT / "runs"))
    return t_start, [json.loads(x) for x in (run_dir / flags["run"] / "metrics.jsonl").read_text().splitlines()]


def rollout_reports(run_dir: Path, run: str) -> dict[str, dict]:
    """{worker: its last rollout report} of a run that has ended, read from the run's own Redis data (its
    append-only file under the run folder, served for the read)."""
    sys.path.insert(0, str(ROOT))
    from services.ops.redis_server import EmbeddedRedis
    from shared.protocol import metrics
    from shared.protocol.keys import Keys
    from shared.runtime.connection import connect

    server = EmbeddedRedis(Path(run_dir) / run / "redis").start()
    try:
        return {r["worker"]: r for _, r in metrics.read(connect(server.url), Keys(run), "rollout")}
    finally:
        server.stop()
