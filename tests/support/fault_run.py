"""A live run for fault drills: the embedded Redis (append-only, fsync every
second) and every Procfile process kind as real subprocesses, each one
killable (kill -9) and restartable the way a supervisor restarts it.

It mirrors services/ops/launch/runner.py (every process gets the same config as
STREAMRL_<KEY> environment variables) but keeps a handle per process.
Rollout workers run as ``python -m tests.support.fault_worker`` (the real worker plus
a probe, see that module).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from services.ops.launch.redis_server import EmbeddedRedis
from shared.protocol.keys import Keys
from shared.protocol.streams import metrics, versions
from shared.runtime.config.keys import FIELDS, Config
from shared.runtime.connection import connect
from tests.support.procs import spawn, wait_until

# process kind -> (module, args)
COMMANDS = {
    "rollout": ("tests.support.fault_worker", ()),
    "tools": ("services.rollout.jobs.tools_worker", ()),
    "trainer": ("services.trainer", ()),
    "syncer": ("services.syncer", ()),
    "driver": ("services.ops.cli.main", ("drive",)),
}


class LiveRun:
    def __init__(self, root: Path, **config):
        self.root = Path(root)
        self.server = EmbeddedRedis(self.root / "redis")
        self.cfg = Config(
            **{k: v for k, v in config.items() if k in FIELDS},
            run_dir=str(self.root / "runs"),
            weights_dir=str(self.root / "weights"),
            redis_url=self.server.url,
        )
        self.keys = Keys(self.cfg.run)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list[Path] = []
        self.count: dict[str, int] = {}
        # killed on purpose
        self.expected_dead: set[str] = set()
        self.client = None
        # what the services connect to: the server, or a fault proxy in front of it
        self.service_url = None

    # --- processes
    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
        # one torch thread per process: six processes on a small box, more threads only fight each other
        url = self.service_url or self.server.url
        env.update({"PYTHONUNBUFFERED": "1", "REDIS_URL": url, "OMP_NUM_THREADS": "1"})
        for name in FIELDS:
            env[f"STREAMRL_{name.upper()}"] = str(getattr(self.cfg, name))
        env["STREAMRL_REDIS_URL"] = url
        return env

    def start(self, rollout_workers: int = 2, proxy=None) -> "LiveRun":
        """``proxy``: called with the server's port, returns the URL the services use instead (a fault proxy)."""
        self.server.start()
        self.service_url = proxy(self.server.port) if proxy else None
        self.client = connect(self.server.url)
        for kind in ("tools", "trainer", "syncer"):
            self.spawn(kind)
        for _ in range(rollout_workers):
            self.spawn("rollout")
        self.spawn("driver")
        return self

    def spawn(self, kind: str) -> str:
        n = self.count[kind] = self.count.get(kind, 0) + 1
        name = f"{kind}-{n}"
        module, args = COMMANDS[kind]
        if kind in ("rollout", "tools"):
            args = (*args, "--worker-id", name)
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.logs.append(log)
        self.procs[name] = spawn(module, *args, env=self.env(), log=log)
        return name

    def names(self, kind: str) -> list[str]:
        return [n for n, p in self.procs.items() if n.startswith(kind + "-") and p.poll() is None]

    def kill(self, name: str) -> None:
        """kill -9 (the process group: nothing of it survives)."""
        proc = self.procs[name]
        self.expected_dead.add(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)

    def probe_and_kill(self, name: str, timeout: float = 30.0) -> dict:
        """Rollout worker: SIGUSR1 (it records its counters and stops itself), then kill -9."""
        since = metrics.read(self.client, self.keys, newest_first=True, count=1)
        cursor = since[0][0] if since else "0-0"
        os.kill(self.procs[name].pid, signal.SIGUSR1)
        try:
            return self.wait(
                lambda: next(
                    (
                        rec
                        for _, rec in metrics.read(self.client, self.keys, "fault_probe", since_id=f"({cursor}")
                        if rec["worker"] == name
                    ),
                    None,
                ),
                f"{name}'s answer to the probe",
                timeout,
                poll=0.02,
            )
        finally:
            self.kill(name)

    def stop(self, timeout: float = 60.0) -> dict[str, int]:
        """Warm stop of every process (SIGTERM, as honcho does), then kill -9 what is left."""
        for name, proc in self.procs.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(name)
                codes[name] = -9
        return codes

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name)
        if self.client is not None:
            self.client.close()
        self.server.stop()

    def check_alive(self) -> None:
        dead = {
            n: p.returncode
            for n, p in self.procs.items()
            if p.poll() is not None and p.returncode != 0 and n not in self.expected_dead
        }
        if dead:
            raise AssertionError(f"processes died: {dead}\n{self.tail()}")

    # --- Redis
    def redis_stop(self) -> None:
        self.server.stop()

    def redis_kill(self) -> None:
        self.server.kill()

    def redis_start(self) -> None:
        self.server.start()

    def current_aof(self) -> Path:
        folder = self.server.data_dir / "appendonlydir"
        manifest = next(folder.glob("*.manifest")).read_text().split("\n")
        name = [line.split()[1] for line in manifest if line.endswith("type i")][-1]
        return folder / name

    def redis_crash(self, lose_seconds: float = 1.0, before_kill=None) -> tuple[float, int]:
        """What a machine crash does under `appendfsync everysec`: the server dies (kill -9) and its
        append-only file is cut back to where it stood ``lose_seconds`` earlier (the writes the OS had not
        put on disk yet); then it starts again from that file. A kill -9 of the server process alone loses
        nothing: its writes are already in the OS's page cache. Returns (unix ms of the cut, bytes cut)."""
        aof = self.current_aof()
        size, cut_ms = aof.stat().st_size, time.time() * 1000
        time.sleep(lose_seconds)
        if before_kill:
            before_kill()
        self.server.kill()
        cut = aof.stat().st_size - size
        os.truncate(aof, size)
        self.server.start()
        return cut_ms, cut

    # --- waiting
    def version(self) -> int:
        return versions.latest_number(self.client, self.keys)

    def wait(self, condition, what: str, timeout: float = 120.0, poll: float = 0.05):
        """``wait_until``, failing also when a process died that was not killed on purpose; the logs' tails
        come with any failure."""

        def alive_and(cond=condition):
            self.check_alive()
            return cond()

        try:
            return wait_until(alive_and, what, timeout, poll=poll)
        except AssertionError as exc:
            if "processes died" in str(exc):
                raise
            raise AssertionError(f"{exc}\n{self.tail()}") from None

    def wait_version(self, at_least: int, timeout: float = 120.0) -> int:
        return self.wait(lambda: self.version() >= at_least and self.version(), f"version {at_least}", timeout)

    def tail(self, lines: int = 15) -> str:
        out = []
        for log in self.logs:
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            out.append(f"--- {log.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)
