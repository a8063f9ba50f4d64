"""The warm process starter (services/ops/launch/starter.py): a forked process is the process asked for, its exit is
reported as Popen reports it, it dies with whoever supervises it, and `streamrl keep` restarts through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from services.ops.launch import starter_client
from tests.support import procs
from tests.support.procs import ROOT, wait_until


class _Pid:
    def __init__(self, pid: int):
        self.pid = pid


@pytest.fixture(scope="module")
def warm():
    """This test worker's starter, the one its other tests fork from (each launch preloads torch: seconds of CPU):
    (an object with its pid, its socket's path)."""
    path = procs._starter_path()
    return _Pid(procs.starter_pid()), path


@pytest.fixture
def own_starter():
    """A starter of the test's own, for a test that stops it."""
    proc, path = starter_client.launch(cwd=ROOT)
    yield proc, path
    starter_client.close(proc, path)


def _start(path, tmp_path, *args, env=None, watch_pid=None):
    out = open(tmp_path / "out.txt", "ab")
    try:
        return starter_client.start(
            path,
            "tests.support.probe_main",
            list(args),
            env={**os.environ, "PROBE": "p1", **(env or {})},
            cwd=str(tmp_path),
            stdout=out.fileno(),
            stderr=out.fileno(),
            watch_pid=watch_pid,
        )
    finally:
        out.close()


def _said(tmp_path) -> dict:
    return json.loads((tmp_path / "out.txt").read_text().splitlines()[0])


def test_a_forked_process_is_the_module_asked_for_with_its_args_env_folder_and_exit_code(warm, tmp_path):
    proc = _start(warm[1], tmp_path, "exit", "3", env={"PYTHONPATH": ROOT})
    assert proc.wait(60) == 3
    said = _said(tmp_path)
    assert said["argv"] == ["exit", "3"] and said["probe"] == "p1" and said["cwd"] == str(tmp_path)
    # warm (a model loads without building transformers' renamings again), and its own session
    assert said["torch_preloaded"] and said["renamings_built"] and said["sid"] == said["pid"] == proc.pid


def test_the_process_is_in_its_own_session_when_start_returns_and_a_bad_request_is_refused(warm, tmp_path):
    import socket

    # as Popen(start_new_session=True): its group can be signalled at once
    for _ in range(5):
        proc = _start(warm[1], tmp_path, "sleep", env={"PYTHONPATH": ROOT})
        assert os.getpgid(proc.pid) == proc.pid
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    # refused; the starter goes on
    for message in (b"", b"not json", json.dumps({"module": 3}).encode()):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(warm[1])
            if message:
                conn.send(message)
            conn.shutdown(socket.SHUT_WR)
            assert conn.recv(4096) == b""
    assert _start(warm[1], tmp_path, "exit", "0", env={"PYTHONPATH": ROOT}).wait(60) == 0


def test_a_crash_goes_through_the_excepthook_and_a_kill_reads_as_minus_the_signal(warm, tmp_path):
    crashed = _start(warm[1], tmp_path, "raise", env={"PYTHONPATH": ROOT})
    assert crashed.wait(60) == 1 and "ValueError: probe raised" in (tmp_path / "out.txt").read_text()
    sleeper = _start(warm[1], tmp_path, "sleep", env={"PYTHONPATH": ROOT})
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    os.killpg(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(30) == -signal.SIGKILL


def test_a_process_dies_with_its_supervisor_and_with_the_starter(own_starter, tmp_path):
    warm = own_starter
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watched = _start(warm[1], tmp_path, "sleep", env={"PYTHONPATH": ROOT}, watch_pid=supervisor.pid)
    orphan = _start(warm[1], tmp_path, "sleep", env={"PYTHONPATH": ROOT})
    supervisor.kill()
    supervisor.wait()
    assert watched.wait(30) == -signal.SIGKILL and orphan.poll() is None
    # the starter gone: its children go too
    starter_client.close(*warm)
    wait_until(lambda: not os.path.exists(f"/proc/{orphan.pid}") or _zombie(orphan.pid), "the starter's child gone", 30)


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_call_runs_a_function_in_a_child_and_says_when_it_fails(warm):
    assert starter_client.call(warm[1], "posixpath:basename", {"p": "/a/b.txt"}) == "b.txt"
    with pytest.raises(starter_client.ChildFailed):
        starter_client.call(warm[1], "posixpath:nope", {})
    with pytest.raises(starter_client.CallFailed) as no_starter:
        starter_client.call(None, "posixpath:basename", {"p": "x"})
    assert not isinstance(no_starter.value, starter_client.ChildFailed)


def test_keep_restarts_a_killed_process_through_the_starter(warm, tmp_path):
    env = {**os.environ, starter_client.ENV: warm[1], "PYTHONPATH": ROOT, "KEEP_PID_DIR": str(tmp_path / "pids")}
    keep = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.ops.launch.keep",
            "--",
            sys.executable,
            "-m",
            "tests.support.probe_main",
            "sleep",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    # keep's output as it comes: a probe killed before it printed says nothing, so the test waits for a line
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(keep.stdout), daemon=True)
    reader.start()
    try:
        from services.ops.launch.keep import processes

        first = wait_until(lambda: processes(tmp_path / "pids").get(NAME), "the first start", 60)[0]
        # forked by the starter, not exec'd by keep
        assert _parent(first) == warm[0].pid
        os.killpg(first, signal.SIGKILL)
        again = wait_until(
            lambda: (p := processes(tmp_path / "pids").get(NAME)) and p[0] != first and p, "the restart", 60
        )
        assert again[1] == 1 and _parent(again[0]) == warm[0].pid
        wait_until(lambda: any('"torch_preloaded"' in line for line in lines), "the restarted probe's line", 60)
    finally:
        keep.terminate()
        keep.wait(timeout=60)
        reader.join(timeout=10)
    out = "".join(lines)
    assert keep.returncode == 0 and "restart 1" in out, out
    # its output relayed through keep
    assert '"torch_preloaded": true' in out


# keep's name for a module outside services/
NAME = "tests.support.probe_main"


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
