"""Asking a run's warm starter (services/ops/launch/starter.py) for a process: ``start`` (``python -m MODULE ARGS``
forked from it, answered by a ``Started``, the part of ``subprocess.Popen``'s interface supervisors use), ``popen``
(forked when a starter was handed down, else an ordinary process), ``call`` (one function run in a forked child, its
JSON result), and a starter's own life from the outside: ``launch``, ``ready``, ``close``, ``inherited``."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading

# where `streamrl keep` finds its run's starter (not STREAMRL_*: those are config keys)
ENV = "STARTER_SOCKET"
# a ``call``'s function and arguments, for the child that runs it
CALL_ENV = "STARTER_CALL"


class Started:
    """A process a starter forked: the part of ``subprocess.Popen``'s interface supervisors and tests use."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, stdout=None, stderr=None):
        self.args, self.pid, self._conn, self.returncode = args, pid, conn, None
        self.stdout, self.stderr = stdout, stderr

    def _read_exit(self, timeout: float | None) -> bool:
        if self.returncode is None and select.select([self._conn], [], [], timeout)[0]:
            message = self._conn.recv(4096)
            # the starter is gone
            self.returncode = json.loads(message)["code"] if message else -signal.SIGKILL
            self._conn.close()
        return self.returncode is not None

    def poll(self) -> int | None:
        self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_exit(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None):
        """(stdout, stderr) text of the pipes it was started with (None for the others), once it has exited."""
        outs = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                outs.append(None)
                continue
            box: list = []
            reader = threading.Thread(target=lambda s=stream: box.append(s.read()), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
            outs.append(box[0])
        self.wait(timeout)
        return tuple(outs)


def python_module(command: list[str]) -> tuple[str, list[str]] | None:
    """(module, args) of a ``python -m MODULE ARGS...`` command line; None for anything else."""
    if len(command) >= 3 and os.path.basename(command[0]).startswith("python") and command[1] == "-m":
        return command[2], list(command[3:])
    return None


def start(
    path: str, module: str, args: list[str], env: dict, cwd: str, stdout: int, stderr: int, watch_pid: int | None = None
) -> Started:
    """Ask the starter at ``path`` for ``python -m module args`` with those file descriptors as its stdout and
    stderr (they stay open here; close them after); ``OSError`` when no starter answers."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        request = {"module": module, "args": args, "env": dict(env), "cwd": cwd, "watch_pid": watch_pid}
        socket.send_fds(conn, [json.dumps(request).encode()], [stdout, stderr])
        answer = conn.recv(4096)
        if not answer:
            raise OSError(f"the starter at {path} closed the connection")
        return Started([sys.executable, "-m", module, *args], json.loads(answer)["pid"], conn)
    except BaseException:
        conn.close()
        raise


def popen(module: str, args: list[str], env: dict, cwd: str):
    """``python -m module args`` with this process's stdout and stderr: forked from the starter this process was
    handed (``inherited``) when there is one, else started the ordinary way (a ``subprocess.Popen``)."""
    path = inherited()
    if path:
        try:
            return start(path, module, args, env=env, cwd=cwd, stdout=1, stderr=2, watch_pid=os.getpid())
        except OSError:
            pass
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, cwd=cwd)


class CallFailed(RuntimeError):
    """``call`` got no answer: no starter, or the child failed (``ChildFailed``)."""


class ChildFailed(CallFailed):
    """The child ran and failed; it said why on stderr."""


def call(path: str | None, target: str, payload: dict, env: dict | None = None, cwd: str | None = None):
    """``module:function(**payload)`` run in a child forked from the starter at ``path`` (so the caller never
    imports what it needs); its JSON result. ``CallFailed`` when that gave no answer."""
    if not path:
        raise CallFailed("no starter")
    read, write = os.pipe()
    env = {**(os.environ if env is None else env), CALL_ENV: json.dumps({"target": target, "payload": payload})}
    try:
        proc = start(
            path, "services.ops.launch.starter", ["--call"], env=env, cwd=cwd or os.getcwd(), stdout=write, stderr=2
        )
    except OSError as exc:
        os.close(read)
        raise CallFailed(str(exc)) from None
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as out:
        answer = out.read()
    code = proc.wait()
    lines = answer.splitlines()
    if code != 0 or not lines:
        raise ChildFailed(f"{target} exited with {code}")
    return json.loads(lines[-1])


def inherited() -> str | None:
    """The socket of a starter this process was handed in ``STARTER_SOCKET`` (a parent's: the tests share one
    per pytest worker), when it is a socket in a folder only this user can reach; None otherwise."""
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        folder, sock = os.stat(os.path.dirname(path)), os.stat(path)
    except OSError:
        return None
    private = folder.st_uid == os.getuid() and not folder.st_mode & 0o077
    return path if private and stat.S_ISSOCK(sock.st_mode) else None


def launch(env: dict | None = None, cwd: str | None = None, wait: bool = True) -> tuple[subprocess.Popen, str]:
    """Start a starter: (its process, its socket's path), once it has preloaded unless ``wait`` is False (then
    call ``ready``). It exits when its stdin (held by the returned process object) is closed, or with the caller."""
    # 0700: only this user can ask it for a process
    folder = tempfile.mkdtemp(prefix="streamrl-starter-")
    path = os.path.join(folder, "sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.ops.launch.starter", path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=cwd,
    )
    if wait:
        ready(proc)
    return proc, path


def ready(proc: subprocess.Popen) -> None:
    """Wait until a launched starter has preloaded; ``RuntimeError`` when it died instead."""
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"the process starter did not start (exit {proc.wait()})")


def close(proc: subprocess.Popen, path: str | None) -> None:
    """Stop a starter ``launch`` started, and remove its folder."""
    path = path or ""
    try:
        proc.stdin.close()
        proc.wait(30)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
    for p in (path, os.path.dirname(path)):
        try:
            os.unlink(p) if p == path else os.rmdir(p)
        except OSError:
            pass
