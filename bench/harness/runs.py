"""One whole `streamrl run` as a benchmark variant: embedded Redis and every Procfile process on a fresh run
namespace, started by the CLI as a user would; returns when the run has ended, with the trainer's metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def streamrl_run(
    flags: dict, verbose: bool = False, on_start=None, root: Path = ROOT, on_line=None, cwd: Path | None = None
) -> tuple[float, list[dict]]:
    """Run ``streamrl run`` with ``flags`` (config keys -> values); (wall time the driver started, the trainer's
    metrics records). Raises SystemExit naming the run when it fails or never starts. ``on_start(process)``: called
    once the ``streamrl run`` process exists (e.g. to watch its processes' CPU). ``root``: the tree whose code runs
    (another one: a git worktree of an earlier commit, for a before/after pair). ``on_line(line)``: called with every
    line the run prints (e.g. to read its end-of-run check). ``cwd``: where it runs (default ``root``; a scratch
    folder makes the default model there, models/tiny)."""
    cmd = [sys.executable, "-m", "services.ops.cli.main", "run"]
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("STREAMRL_")}
    # the Procfile's python, streamrl
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if root != ROOT or cwd is not None:
        # its modules before the editable install's (run from elsewhere: this tree's)
        env["PYTHONPATH"] = str(root)
    print(f"\n== {' '.join(cmd[4:])}", flush=True)
    t_start, last_line = None, ""
    proc = subprocess.Popen(cmd, cwd=cwd or root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if on_start is not None:
        on_start(proc)
    for line in proc.stdout:
        if on_line is not None:
            on_line(line.rstrip())
        if "driver" in line and "started;" in line and t_start is None:
            t_start = time.time()
        if "driver" in line and ("[" in line or "ending the run" in line or "up at version" in line):
            last_line = line.rstrip()
            if verbose or "ending" in line or "up at" in line:
                print("   " + last_line, flush=True)
    rc = proc.wait()
    if rc != 0 or t_start is None:
        raise SystemExit(
            f"{flags['run']}: streamrl run exited {rc} (driver started: {t_start is not None}); last: {last_line}"
        )
    run_dir = Path(flags.get("run_dir", root / "runs"))
    return t_start, [json.loads(x) for x in (run_dir / flags["run"] / "metrics.jsonl").read_text().splitlines()]


def rollout_reports(run_dir: Path, run: str) -> dict[str, dict]:
    """{worker: its last rollout report} of a run that has ended, read from the run's own Redis data (its
    append-only file under the run folder, served for the read)."""
    sys.path.insert(0, str(ROOT))
    from services.ops.launch.redis_server import EmbeddedRedis
    from shared.protocol.keys import Keys
    from shared.protocol.streams import metrics
    from shared.runtime.connection import connect

    server = EmbeddedRedis(Path(run_dir) / run / "redis").start()
    try:
        # files + Redis
        found = metrics.history(connect(server.url), Keys(run), Path(run_dir) / run, ("rollout",))
        return {r["worker"]: r for r in found["rollout"]}
    finally:
        server.stop()


@contextmanager
def scratch_server(weights_in_shm: bool = False):
    """A temporary folder with an embedded Redis serving from ``<tmp>/redis``, both gone afterwards:
    ``(tmp, url, weights_dir)``; ``weights_dir`` is a second temporary folder, in /dev/shm when there is one and
    ``weights_in_shm`` (weight files there cost no disk I/O), else None."""
    sys.path.insert(0, str(ROOT))
    from services.ops.launch.redis_server import EmbeddedRedis

    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-") as tmp_name, ExitStack() as stack:
        weights = (
            Path(stack.enter_context(tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None)))
            if weights_in_shm
            else None
        )
        tmp = Path(tmp_name)
        server = EmbeddedRedis(tmp / "redis").start()
        try:
            yield tmp, server.url, weights
        finally:
            server.stop()


# ~30M parameters, float32
MEDIUM = dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=2048)


def keep_only(folder: Path, newest: Path) -> None:
    """Remove every weights file in ``folder`` but ``newest``, as the trainer prunes its folder."""
    for old in folder.glob("v*.safetensors"):
        if old != newest:
            old.unlink()


def kill_all(procs) -> None:
    """SIGKILL each process group of ``procs`` (rollout workers started with ``start_new_session``), and reap it."""
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def finish(table: str, t_start: float, results, as_json: bool) -> int:
    """The end of a bench's ``main``: its table, the total time, the figures as JSON when asked; exit code 0."""
    print(table)
    print(f"(total {time.perf_counter() - t_start:.1f} s)")
    if as_json:
        print(json.dumps(results, indent=1, default=str))
    return 0


def wait(cond, what: str, procs, timeout: float = 300.0):
    """``cond()``'s value once truthy, polled every 50 ms; fails naming ``what`` when a rollout worker process of
    ``procs`` exits meanwhile or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        for p in procs:
            assert p.poll() is None, f"a rollout worker exited with {p.returncode} waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value
