"""The one way tests start service processes and wait for something to happen.

`spawn` starts `python -m <module> <args>` in its own process group (so `kill9` takes everything it
started); `wait_until` polls a condition against a deadline, fails naming what it waited for, and
fails at once when a process the test depends on has died. No test sleeps a fixed time to
synchronise with another process: it waits for the state it needs.

`spawn` forks its processes from a warm interpreter that has imported torch and transformers once (the same
starter `streamrl run` uses, `services/ops/launch/starter.py`, one per pytest worker) instead of paying those imports
in every process; `TESTS_COLD_START=1` starts each with a fresh interpreter instead. Either way the handle
answers as `subprocess.Popen` does (`pid`, `args`, `poll`, `wait`, `returncode`, `terminate`, `communicate`).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.ops.launch import starter_client

ROOT = str(Path(__file__).resolve().parents[2])
# how often a condition is re-read; only the deadline bounds how long a wait may take
POLL_S = 0.05
WARM = os.environ.get("TESTS_COLD_START", "") in ("", "0")


_starter: dict = {}
_starter_lock = threading.Lock()


def _starter_path(wait: bool = True) -> str:
    """This pytest worker's starter (launched once; it exits with the worker): its socket's path, once it serves
    unless ``wait`` is False."""
    with _starter_lock:
        if _starter.get("pid") != os.getpid():
            proc, path = starter_client.launch(cwd=ROOT, wait=False)
            atexit.register(starter_client.close, proc, path)
            _starter.update(pid=os.getpid(), path=path, proc=proc, ready=False)
        if wait and not _starter["ready"]:
            starter_client.ready(_starter["proc"])
            _starter["ready"] = True
        return _starter["path"]


def share_starter() -> None:
    """Hand this worker's starter to every process the tests start in ``STARTER_SOCKET``, so a `streamrl run` or
    `streamrl keep` a test starts forks its processes from it instead of preloading a starter of its own (tests
    of that path take the variable out of the environment they give). Nothing with ``TESTS_COLD_START=1``."""
    if WARM:
        os.environ[starter_client.ENV] = _starter_path(wait=False)


def starter_pid() -> int | None:
    """The pid of this worker's starter, when it has one."""
    return _starter["proc"].pid if _starter.get("pid") == os.getpid() else None


def _spawn_warm(module: str, args: list[str], env: dict | None, out_fd: int | None, stderr_pipe: bool):
    err_r = err_w = None
    if stderr_pipe:
        err_r, err_w = os.pipe()
    try:
        proc = starter_client.start(
            _starter_path(),
            module,
            args,
            os.environ if env is None else env,
            ROOT,
            out_fd if out_fd is not None else 1,
            out_fd if out_fd is not None else err_w if err_w is not None else 2,
        )
    except BaseException:
        if err_r is not None:
            os.close(err_r)
        raise
    finally:
        if err_w is not None:
            os.close(err_w)
    if err_r is not None:
        proc.stderr = open(err_r, encoding="utf-8", errors="replace")
    return proc


def spawn(module: str, *args: str, env: dict | None = None, log: str | Path | None = None, stderr_pipe: bool = False):
    """``python -m module args`` from the project root, in a new session; its output to ``log`` if given, or its
    stderr to a text pipe (``proc.communicate()``) with ``stderr_pipe``."""
    out = open(log, "ab") if log else None
    try:
        # as streamrl run: cold
        vllm = "vllm" in (env or os.environ).get("STREAMRL_ENGINE", "") or "vllm" in args
        if WARM and not module.startswith("torch.") and not vllm:
            return _spawn_warm(module, [str(a) for a in args], env, out.fileno() if out else None, stderr_pipe)
        return subprocess.Popen(
            [sys.executable, "-m", module, *map(str, args)],
            env=env,
            cwd=ROOT,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT if out else subprocess.PIPE if stderr_pipe else None,
            text=stderr_pipe or None,
        )
    finally:
        if out:
            out.close()


def run_module(
    module: str,
    *args,
    env: dict | None = None,
    input: bytes | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """``python -m module args`` to its end from the project root, its stdout and stderr captured (bytes), as
    ``subprocess.run(..., capture_output=True)`` answers; forked from this worker's starter unless it reads stdin
    (``input``) or ``TESTS_COLD_START=1``. ``subprocess.TimeoutExpired`` past ``timeout`` (the process killed)."""
    argv = [sys.executable, "-m", module, *map(str, args)]
    if not WARM or input is not None:
        return subprocess.run(argv, env=env, cwd=ROOT, input=input, capture_output=True, timeout=timeout)
    pipes = [os.pipe(), os.pipe()]
    try:
        proc = starter_client.start(
            _starter_path(), module, argv[3:], os.environ if env is None else env, ROOT, pipes[0][1], pipes[1][1]
        )
    except BaseException:
        for r, _ in pipes:
            os.close(r)
        raise
    finally:
        for _, w in pipes:
            os.close(w)
    got: list[bytes] = [b"", b""]

    def drain(i: int) -> None:
        with open(pipes[i][0], "rb") as fh:
            got[i] = fh.read()

    readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in (0, 1)]
    for t in readers:
        t.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise
    for t in readers:
        t.join(30)
    return subprocess.CompletedProcess(argv, code, got[0], got[1])


def gone_worker_id(service: str = "rollout") -> str:
    """A worker id of this host in ``shared.runtime.heartbeat.new_worker_id``'s form whose process has exited and been
    reaped: what ``heartbeat.gone`` calls certainly dead."""
    import socket

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return f"{service}-{socket.gethostname()}-{proc.pid}-dead"


def kill9(*procs) -> None:
    """kill -9 each process's group and reap it."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)


def stop(*procs, timeout: float = 30.0) -> list[int]:
    """Warm stop (SIGTERM, as honcho does); kill -9 what has not exited by ``timeout``. The exit codes."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout))
        except subprocess.TimeoutExpired:
            kill9(proc)
            codes.append(proc.returncode)
    return codes


def wait_until(cond, what: str, timeout: float = 90.0, procs=(), poll: float = POLL_S):
    """Poll ``cond()`` until it is truthy and return its value; ``AssertionError`` naming ``what`` at the
    deadline, or as soon as one of ``procs`` has exited."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(
                    f"a process ({proc.args[2] if len(proc.args) > 2 else proc.args}) exited "
                    f"with {proc.returncode} while waiting for {what}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)
