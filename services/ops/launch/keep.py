"""`streamrl keep -- COMMAND...`: run one process of the run and start it again when it crashes.

Every Procfile line runs under it, so a crash does not end the run, under `streamrl run` and under a plain
`honcho start` alike (honcho stops every process when one exits; this process exits only when the run should
end). What it does when its process exits (``decide``, a pure rule over the recent crash times):

- exit 0 (the driver ended the run, a warm stop): exits 0 too, and the run ends as before;
- exit 2 (a bad config value, a run-identity mismatch: the process already said why, in one line) or 78 (the
  driver found the run cannot train): starting it again cannot help, so it exits with that code and the run stops;
- anything else (a crash, kill -9, Redis gone for longer than ``redis_wait``): starts it again after a backoff
  (0.1 s, doubling up to 10 s, counted over the last minute), one log line per restart;
- more than ``MAX_RESTARTS`` crashes in a row within ``WINDOW_S``, each within ``STABLE_S`` of its start (it
  never came up): a crash loop; it exits with the process's code and its last line, and the run stops. A kill
  that ``--chaos`` made (``mark_injected``) is not the process failing to come up and never counts towards one.

SIGTERM / SIGINT (honcho stopping the run) is passed to the process once and nothing is restarted after it.
The process runs in its own process group (``--chaos`` and drills kill it with its children), and dies with
this one (Linux: the parent-death signal), so a kill -9 of the supervisor leaves no orphan behind. Under
`streamrl run` a ``python -m MODULE`` line is forked from the run's warm starter (``services/ops/launch/starter.py``:
torch and transformers already imported, so a restart after a crash does not import them again); with no
starter (a plain ``honcho start``) it is started the ordinary way.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.driver.failfast import CANNOT_TRAIN
from services.ops.launch import starter_client

WINDOW_S = 60.0
MAX_RESTARTS = 5
# a process that ran this long had come up: its crash is not part of a loop
STABLE_S = 10.0
# systemd's RestartSec default; measured: 0.5 cost --chaos 5 about 9 s a run
BACKOFF_S, BACKOFF_MAX_S = 0.1, 10.0
# the process refused its config or its run, or the driver found the run cannot train (services/driver/failfast.py):
# the same again would fail the same way
FATAL_CODES = (2, CANNOT_TRAIN)
# given to the process: when keep first started it (the driver's max_minutes clock)
SINCE_ENV = "KEEP_SINCE"
# the process's name in the run (honcho's: rollout.2), for its lines and its pid file
NAME_ENV = "KEEP_NAME"
# where each kept child's pid is written (not STREAMRL_*: those are config keys)
PID_DIR_ENV = "KEEP_PID_DIR"


@dataclass
class History:
    # monotonic times of crashes within the window
    crashes: list[float] = field(default_factory=list)
    restarts: int = 0


def decide(
    code: int, stopping: bool, crashes: list[float], now: float, ran_s: float = 0.0
) -> tuple[str, float, list[float]]:
    """What to do when the process exited with ``code`` (negative: killed by that signal) after running ``ran_s``
    seconds: ("end", 0) exit as it did, ("fatal", 0) exit 2 at once, ("loop", 0) a crash loop, ("restart", delay
    seconds), each with the crash times (``crashes``, the earlier ones) the caller keeps for next time. A process
    that ran ``STABLE_S`` or more had come up: its crash starts the count and the backoff afresh (a kill -9 now and
    then is not a loop, however often it happens); one that died sooner counts. Pure: it changes nothing given."""
    if stopping or code == 0:
        return "end", 0.0, list(crashes)
    if code in FATAL_CODES:
        return "fatal", 0.0, list(crashes)
    recent = [] if ran_s >= STABLE_S else [t for t in crashes if now - t < WINDOW_S]
    recent.append(now)
    if len(recent) > MAX_RESTARTS:
        return "loop", 0.0, recent
    return "restart", min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (len(recent) - 1)), recent


def mark_injected(pid_dir, pid: int) -> None:
    """Say, before killing process ``pid``, that its death is injected (``--chaos``), not its own failure."""
    Path(pid_dir, f"{pid}.chaos").touch()


def _injected(pid: int) -> bool:
    """Whether ``mark_injected`` named this process (the mark is consumed)."""
    pid_dir = os.environ.get(PID_DIR_ENV)
    if not pid_dir:
        return False
    try:
        os.unlink(os.path.join(pid_dir, f"{pid}.chaos"))
        return True
    except FileNotFoundError:
        return False


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _die_with_parent() -> None:
    """In the child before exec: its own process group, and SIGKILL when this supervisor dies (Linux)."""
    os.setpgrp()
    try:
        # PR_SET_PDEATHSIG
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def name_of(command: list[str]) -> str:
    """A short name for logs: the last part of ``python -m services.X.Y`` (``rollout``, ``tools_worker``), else
    the program."""
    if "-m" in command[:-1]:
        module = command[command.index("-m") + 1]
        return module.rsplit(".", 1)[-1] if module.startswith("services.") else module
    return " ".join(os.path.basename(w) for w in command[:2])


class Keeper:
    def __init__(self, command: list[str], name: str | None = None, out=None):
        self.command, self.name = command, name or os.environ.get(NAME_ENV) or name_of(command)
        self.out = out or sys.stdout
        self.stopping = False
        self.child: subprocess.Popen | starter_client.Started | None = None
        self.last_line = ""
        self.history = History()
        # the driver's max_minutes runs from here, across its restarts
        self.since = time.time()

    def _signal(self, signum, frame) -> None:
        if self.stopping:
            return
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            os.kill(self.child.pid, signum)

    def say(self, text: str) -> None:
        print(f"keep: {self.name} {text}", file=self.out, flush=True)

    def _start(self) -> None:
        env = {**os.environ, SINCE_ENV: os.environ.get(SINCE_ENV, str(self.since))}
        self.child = self._start_warm(env) or subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, env=env
        )
        pid_dir = os.environ.get(PID_DIR_ENV)
        # `streamrl run`: --chaos picks its victims here, the end-of-run check counts the restarts
        if pid_dir:
            os.makedirs(pid_dir, exist_ok=True)
            tmp = os.path.join(pid_dir, f".{os.getpid()}.tmp")
            with open(tmp, "w") as fh:
                fh.write(f"{self.child.pid} {self.name} {self.history.restarts}\n")
            os.replace(tmp, os.path.join(pid_dir, f"{os.getpid()}.pid"))

    def _start_warm(self, env: dict) -> starter_client.Started | None:
        """The process forked by the run's starter, its output on a pipe to here; None when there is no starter
        or it does not answer (then the process starts the ordinary way)."""
        path, target = starter_client.inherited(), starter_client.python_module(self.command)
        if not path or target is None:
            return None
        read, write = os.pipe()
        try:
            child = starter_client.start(
                path, *target, env=env, cwd=os.getcwd(), stdout=write, stderr=write, watch_pid=os.getpid()
            )
        except OSError:
            os.close(read)
            return None
        finally:
            os.close(write)
        child.stdout = os.fdopen(read, "rb")
        return child

    def _relay(self) -> int:
        """Copy the child's output through, remembering its last line; its exit code."""
        for raw in iter(self.child.stdout.readline, b""):
            line = raw.decode(errors="replace")
            if line.strip():
                self.last_line = line.strip()
            self.out.write(line)
            self.out.flush()
        return self.child.wait()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGINT, self._signal)
        while True:
            self._start()
            began = time.monotonic()
            # the signal came while it was starting
            if self.stopping and self.child.poll() is None:
                os.kill(self.child.pid, signal.SIGTERM)
            code = self._relay()
            now = time.monotonic()
            # an injected kill counts as the death of a process that had come up
            ran = STABLE_S if _injected(self.child.pid) else now - began
            action, delay, self.history.crashes = decide(code, self.stopping, self.history.crashes, now, ran)
            # a clean exit, or the run stopping: a signal's own exit is clean too
            if action == "end":
                return 0 if code in (0, -signal.SIGTERM, -signal.SIGINT) else (code if code > 0 else 1)
            if action == "fatal":
                return code
            if action == "loop":
                self.say(
                    f"crashed {len(self.history.crashes)} times within {WINDOW_S:g} s ({describe(code)}); "
                    f"stopping the run. Its last line: {self.last_line or '(none)'}"
                )
                return code if code > 0 else 1
            self.history.restarts += 1
            self.say(
                f"{describe(code)}; restart {self.history.restarts} in {delay:g} s "
                f"({len(self.history.crashes)} in a row within {WINDOW_S:g} s)"
            )
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not self.stopping:
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            if self.stopping:
                return 0


def processes(pid_dir) -> dict[str, tuple[int, int]]:
    """{name: (its current pid, restarts so far)} from the files each ``keep`` writes in ``pid_dir``."""
    out = {}
    for path in sorted(Path(pid_dir).glob("*.pid")) if pid_dir and Path(pid_dir).is_dir() else []:
        try:
            pid, name, restarts = path.read_text().split()
        except (OSError, ValueError):
            # being replaced, or not ours
            continue
        out[name] = (int(pid), int(restarts))
    return out


def keep_server(server, stop, out=None, log_every_s: float = 0.1):
    """`streamrl run`'s own embedded Redis under the same rule, on a thread until ``stop`` (an Event) is set: when
    its process dies, it is started again on the same port over its append-only data, every service waits for it
    (``redis_wait``) and goes on. Returns the thread; ``thread.restarts`` counts them and ``thread.failed`` is the
    line that gave up (a crash loop, or a start that failed)."""
    import threading

    history = History()
    out = out or sys.stderr

    def watch() -> None:
        # a process watch (no Redis round trip): is the server's process alive
        while not stop.wait(log_every_s):
            code = server.proc.poll() if server.proc is not None else None
            if code is None:
                continue
            # a server that start() returned is up (it answered); a Redis that cannot come up fails start() instead
            action, delay, history.crashes = decide(
                code if code else 1, False, history.crashes, time.monotonic(), STABLE_S
            )
            if action != "restart":
                thread.failed = f"the embedded Redis crashed {len(history.crashes)} times within {WINDOW_S:g} s"
                print(f"keep: {thread.failed}; not starting it again", file=out, flush=True)
                return
            thread.restarts += 1
            print(
                f"keep: redis {describe(code)}; restart {thread.restarts} in {delay:g} s on port {server.port}",
                file=out,
                flush=True,
            )
            if stop.wait(delay):
                return
            try:
                server.start()
            # the port taken meanwhile, the data folder gone: say so, stop watching
            except Exception as exc:
                thread.failed = f"the embedded Redis did not start again: {exc}"
                print(f"keep: {thread.failed}", file=out, flush=True)
                return

    thread = threading.Thread(target=watch, daemon=True, name="keep-redis")
    thread.restarts, thread.failed = 0, None
    thread.start()
    return thread


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(
            "streamrl keep: expected a command after '--' (e.g. streamrl keep -- python -m services.trainer)",
            file=sys.stderr,
        )
        return 2
    return Keeper(argv).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
