"""`streamrl keep`: the restart rule (pure), and the supervisor around real processes: a crash is restarted, a
clean exit ends, exit 2 is not retried, a crash loop stops with the process's last line, SIGTERM reaches the
process once and nothing restarts after it; `streamrl run`'s own Redis is started again when it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from services.driver.failfast import CANNOT_TRAIN
from services.ops.launch import keep
from services.ops.launch.keep import BACKOFF_MAX_S, BACKOFF_S, MAX_RESTARTS, WINDOW_S, History, decide
from services.ops.launch.redis_server import EmbeddedRedis
from shared.runtime.connection import connect
from tests.support.procs import wait_until


def decide_on(h: History, code: int, now: float, ran_s: float = 0.0, stopping: bool = False) -> tuple[str, float]:
    """The rule as the supervisor uses it: the crash times it returns are the history of the next call."""
    given, before = list(h.crashes), list(h.crashes)
    action, delay, h.crashes = decide(code, stopping, given, now, ran_s)
    # pure: the list it was given is left as it was
    assert given == before
    return action, delay


def test_the_rule_restarts_crashes_with_backoff_and_stops_a_loop():
    h = History()
    delays = [decide_on(h, 1, t)[1] for t in (0.0, 1.0, 2.0, 3.0, 4.0)]
    assert delays == sorted(delays) and delays[0] == BACKOFF_S and max(delays) <= BACKOFF_MAX_S
    # the sixth crash within the window
    assert decide_on(h, -9, 5.0)[0] == "loop"
    h = History()
    for t in range(MAX_RESTARTS):
        # one a minute: never a loop, the backoff starts over
        decide_on(h, 1, t * WINDOW_S)
    assert decide_on(h, 1, MAX_RESTARTS * WINDOW_S) == ("restart", BACKOFF_S)
    h = History()
    # killed every 12 s after coming up (chaos): never a loop, no backoff
    for t in range(3 * MAX_RESTARTS):
        assert decide_on(h, -9, 12.0 * t, ran_s=11.0) == ("restart", BACKOFF_S)
    assert decide_on(History(), 0, 0.0) == ("end", 0.0)
    # a config or run-identity error
    assert decide_on(History(), 2, 0.0) == ("fatal", 0.0)
    # the driver found the run cannot train (services/driver/failfast.py)
    assert decide_on(History(), CANNOT_TRAIN, 0.0) == ("fatal", 0.0)
    # the run is stopping: nothing restarts
    assert decide_on(History(), -9, 0.0, stopping=True) == ("end", 0.0)
    assert decide(1, False, [0.0, 1.0], 2.0)[2] == [0.0, 1.0, 2.0]


def _script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "proc.py"
    path.write_text(body)
    return [sys.executable, str(path)]


def _keep(command, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "services.ops.launch.keep", "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kw,
    )


def test_a_crashing_process_is_started_again_until_it_ends_cleanly(tmp_path):
    count = tmp_path / "count"
    cmd = _script(
        tmp_path,
        f"""
import os, sys
p = {str(count)!r}
n = int(open(p).read()) if os.path.exists(p) else 0
open(p, "w").write(str(n + 1))
print("run", n, flush=True)
if n == 0:
    os.kill(os.getpid(), 9)   # killed by a signal
sys.exit(1 if n == 1 else 0)  # then a crash, then a clean end
""",
    )
    out, _ = _keep(cmd).communicate(timeout=60)
    assert count.read_text() == "3"
    assert "keep: " in out and "killed by SIGKILL; restart 1" in out and "exit code 1; restart 2" in out
    assert out.count("run ") == 3


def test_exit_2_is_not_retried_and_a_crash_loop_stops_with_the_last_line(tmp_path, monkeypatch):
    p = _keep(_script(tmp_path, "import sys; print('bad value for key x', flush=True); sys.exit(2)"))
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 2 and out.count("bad value") == 1 and "restart" not in out
    loop = _keep(_script(tmp_path, "import sys; print('boom: the last words', flush=True); sys.exit(3)"))
    # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s of backoff
    out, _ = loop.communicate(timeout=120)
    assert loop.returncode == 3
    # the first run and 5 restarts
    assert out.splitlines().count("boom: the last words") == MAX_RESTARTS + 1
    assert f"crashed {MAX_RESTARTS + 1} times" in out and "Its last line: boom: the last words" in out


def test_sigterm_reaches_the_process_once_and_nothing_restarts(tmp_path):
    marks = tmp_path / "marks"
    cmd = _script(
        tmp_path,
        f"""
import signal, sys, time
def stop(*a):
    open({str(marks)!r}, "a").write("term\\n")
    time.sleep(0.5)   # a warm stop
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(0.2)
""",
    )
    p = _keep(cmd)
    assert p.stdout.readline().strip() == "ready"
    # as honcho stops a run: the supervisor's group
    os.killpg(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and marks.read_text() == "term\n" and "restart" not in out


def test_a_killed_supervisor_takes_its_process_with_it(tmp_path):
    pidfile = tmp_path / "pid"
    cmd = _script(tmp_path, f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    p = _keep(cmd)
    wait_until(lambda: pidfile.exists() and pidfile.read_text(), "the child's pid")
    child = int(pidfile.read_text())
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)

    def gone():
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        # a zombie awaiting its reaper is dead too
        return open(f"/proc/{child}/stat").read().split()[2] == "Z"

    wait_until(gone, "the orphan killed")


def test_the_runs_own_redis_is_started_again_on_its_port_with_its_data(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    stop = threading.Event()
    try:
        client = connect(server.url)
        client.set("k", "v")
        # appendfsync everysec
        time.sleep(1.2)
        lines = []
        watcher = keep.keep_server(
            server, stop, out=type("W", (), {"write": lambda s, x: lines.append(x), "flush": lambda s: None})()
        )
        os.kill(server.proc.pid, signal.SIGKILL)
        wait_until(
            lambda: watcher.restarts == 1 and connect(server.url, wait=5).get("k") == b"v",
            "redis back with its data",
            timeout=30,
        )
        assert any("redis killed by SIGKILL; restart 1" in x for x in lines)
    finally:
        stop.set()
        server.stop()


def test_chaos_picks_only_allowed_kinds_and_sums_up_kills_restarts_and_recovery():
    import random

    from services.ops.launch.chaos import Chaos, Kill, summary

    c = Chaos(5.0, seed=3, only=frozenset({"rollout", "redis"}))
    rng = random.Random(3)
    picks = {c.choose(rng, ["rollout.1", "rollout.2", "trainer", "redis"]) for _ in range(50)}
    assert picks == {"rollout.1", "rollout.2", "redis"}
    assert c.choose(rng, ["trainer"]) is None
    c.kills = [Kill(100.0, "rollout.1"), Kill(110.0, "redis"), Kill(130.0, "rollout.1")]
    lines = summary(c, [99.0, 101.5, 114.0], {"rollout.1": 2, "trainer": 0, "redis": 1}, 40.0)
    assert lines[0] == "chaos: 3 kills in 40 s (one every 5 s, seed 3): redis 1, rollout.1 2"
    assert lines[1] == "  restarts: redis 1, rollout.1 2"
    assert lines[2] == "  kill to the next version: median 2.8 s, max 4.0 s (2 of 3 kills were followed by a version)"
    assert lines[3] == "  by process: redis median 4.0 s, max 4.0 s, rollout median 1.5 s, max 1.5 s"


def test_chaos_reads_every_versions_time_from_the_runs_metrics_file(tmp_path):
    """Kill-to-next-version needs every version's time: the run's metrics file has every training step (the
    versions stream in Redis keeps only its last entries, and an early kill measured against it waited minutes)."""
    import json

    from services.ops.launch.chaos import Chaos, Kill, summary, version_times

    records = [{"step": s, "time": 100.0 + s, "train_s": 0.1} for s in (4, 1, 2, 3)] + [{"kind": "other", "time": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert version_times(tmp_path, 1) == [101.0, 102.0, 103.0, 104.0]
    # two steps per version: versions come from steps 2 and 4
    assert version_times(tmp_path, 2) == [102.0, 104.0]
    c = Chaos(5.0, seed=0)
    c.kills = [Kill(101.5, "trainer")]
    assert (
        summary(c, version_times(tmp_path, 1), {"trainer": 1}, 10.0)[3]
        == "  by process: trainer median 0.5 s, max 0.5 s"
    )


def test_a_restarted_process_keeps_the_time_it_was_first_started(tmp_path):
    """The driver's max_minutes clock runs across its restarts: keep gives every start the same KEEP_SINCE."""
    from services.driver.driver import SINCE_ENV as DRIVER_READS

    assert keep.SINCE_ENV == DRIVER_READS
    seen = tmp_path / "seen"
    cmd = _script(
        tmp_path,
        f"""
import os, sys
with open({str(seen)!r}, "a") as fh:
    fh.write(os.environ[{keep.SINCE_ENV!r}] + "\\n")
sys.exit(1 if len(open({str(seen)!r}).read().split()) < 2 else 0)
""",
    )
    t0 = time.time()
    _keep(cmd).communicate(timeout=60)
    first, second = seen.read_text().split()
    assert first == second and t0 - 5 < float(first) <= time.time()


def test_kills_chaos_made_are_restarted_however_often_and_never_taken_for_a_crash_loop(tmp_path):
    """Seven kill -9s in a row, each seconds after the start, each marked as injected (as --chaos marks its
    victims): all restarted, no crash loop, and the marks are consumed. Unmarked, the sixth would stop the run."""
    count, pids = tmp_path / "count", tmp_path / "procs"
    cmd = _script(
        tmp_path,
        f"""
import os, sys
sys.path.insert(0, {str(keep.__file__.rsplit("/services/", 1)[0])!r})
from services.ops.launch.keep import mark_injected
p = {str(count)!r}
n = int(open(p).read()) if os.path.exists(p) else 0
open(p, "w").write(str(n + 1))
if n < 7:
    mark_injected({str(pids)!r}, os.getpid())
    os.kill(os.getpid(), 9)
print("came up", flush=True)
""",
    )
    p = _keep(cmd, env={**os.environ, keep.PID_DIR_ENV: str(pids)})
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert count.read_text() == "8" and "restart 7 in 0.1 s" in out and "crashed" not in out
    assert not list(pids.glob("*.chaos"))
