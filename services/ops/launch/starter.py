"""A warm process starter: ``python -m MODULE ARGS`` without paying ``import torch`` in every process.

A rollout worker or a trainer spends 2.5-3.5 CPU-seconds importing torch and transformers before its first line
of work; on a restart after a crash that is most of the time the run waits for it. `streamrl run` starts one
starter per run (``python -m services.ops.launch.starter SOCKET``): it imports those libraries once, then serves
requests on a Unix socket in a private (0700) folder. Each request forks a child that becomes the requested
process: its own session (``--chaos`` and drills kill its group), the stdout/stderr passed over the socket, the
environment, folder and ``sys.argv`` asked for, and the module run with ``runpy`` as ``python -m`` runs it. The
project's own modules are not pre-imported: the child imports them under its own environment, as a fresh
interpreter would. This is how gunicorn's ``--preload`` starts workers, and how PyTorch's fork-started
DataLoader workers start (torch registers fork handlers for its thread pools); nothing in the starter runs a
torch operation or starts a thread before it forks. pyarrow is left out (its allocator starts a thread).

The starter reaps its children and reports each exit status on the connection that asked for it, so the asking side's
handle (``Started``, services/ops/launch/starter_client.py: how a process asks for one) answers
``poll``/``wait``/``returncode`` like ``subprocess.Popen``. A child dies with the starter (the parent-death signal) and,
given ``watch_pid``, with the process that asked for it (`streamrl keep`), so no kill leaves an orphan. The starter
exits when its stdin closes (its runner is gone). Whoever cannot reach a starter starts the process the ordinary way
(``streamrl keep`` under a plain ``honcho start`` always does).

Protocol (SOCK_SEQPACKET, one message each way per step): the request is JSON ``{"module", "args", "env",
"cwd", "watch_pid"}`` with two file descriptors (stdout, stderr) attached; the answer ``{"pid": N}``, then, when
that child exits, ``{"code": C}`` (``Popen.returncode``'s convention: -N for signal N).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading

PRELOAD = (
    "torch",
    "numpy",
    "redis",
    "rq",
    "msgpack",
    "structlog",
    "safetensors",
    "zstandard",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "uvicorn",
    "uvloop",
    "httptools",
    "starlette",
    "fastapi",
    "httpx",
)
MAX_MESSAGE = 1 << 20


def preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (fills the lazy maps)

    # Every from_pretrained builds transformers' table of checkpoint renamings once per process, compiling about
    # a thousand regular expressions, most of a small model's load: built here, a restarted trainer or rollout worker
    # inherits it and loads its model at once.
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        get_checkpoint_conversion_mapping("llama")
    except ImportError:
        pass


def _prctl(option: int, arg) -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _die_with(pid: int) -> None:
    """A daemon thread in the child: SIGKILL itself when process ``pid`` (its supervisor) is gone."""
    try:
        fd = os.pidfd_open(pid)
    # gone before we looked
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
    except (OSError, AttributeError):
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-supervisor", daemon=True).start()


def _child(request: dict, fds: list[int], started: int) -> None:
    """In the forked child: become the requested process and run it; never returns. ``started`` is closed once
    it is in its own session and dies with its supervisor, as ``Popen(start_new_session=True)`` returns."""
    code = 1
    try:
        os.setsid()
        # PR_SET_PDEATHSIG: die with the starter
        _prctl(1, signal.SIGKILL)
        if request.get("watch_pid"):
            _die_with(int(request["watch_pid"]))
        os.close(started)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        # SIGPIPE stays ignored, as Python sets it
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *[p for p in sys.path[1:] if p not in extra]]
        if "OMP_NUM_THREADS" in os.environ:
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.argv = [request["module"], *request["args"]]
        # PR_SET_NAME: ps/top show the module
        _prctl(15, request["module"].rsplit(".", 1)[-1][:15].encode())
        import runpy

        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            # a service's own hook, as the interpreter would call it
            sys.excepthook(*sys.exc_info())
            code = 1
        # as the interpreter does at exit: wait for non-daemon threads
        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing left to say
                pass
        os._exit(code & 0xFF)


def _request(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """A request read from a new connection and its two file descriptors; (None, []) for anything else."""
    try:
        message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
    except OSError:
        return None, []
    try:
        request = json.loads(message)
        if isinstance(request, dict) and isinstance(request.get("module"), str) and len(fds) == 2:
            return request, fds
    except ValueError:
        pass
    for fd in fds:
        os.close(fd)
    return None, []


def serve(path: str) -> None:
    """The starter's loop: preload, then fork a child per request and report each child's exit."""
    preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # a Ctrl-C reaches the whole group: the runner ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([server, wake_r, sys.stdin], [], [])
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            # whoever started us is gone
            return
        if server in readable:
            conn, _ = server.accept()
            request, fds = _request(conn)
            # a connection that said nothing usable: it gets nothing, the starter goes on
            if request is None:
                conn.close()
                continue
            started_r, started_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                server.close()
                os.close(wake_r)
                os.close(wake_w)
                os.close(started_r)
                for other in waiting.values():
                    other.close()
                conn.close()
                _child(request, fds, started_w)
            for fd in (*fds, started_w):
                os.close(fd)
            # end of file: the child is in its own session (or already dead)
            os.read(started_r, 1)
            os.close(started_r)
            conn.send(json.dumps({"pid": pid}).encode())
            waiting[pid] = conn
        if wake_r in readable:
            os.read(wake_r, 4096)
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                conn.close()


def _call_main() -> None:
    """In a child started by ``call``: run the function and print its result as the last line."""
    import importlib

    from services.ops.launch.starter_client import CALL_ENV

    request = json.loads(os.environ.pop(CALL_ENV))
    module, function = request["target"].split(":")
    result = getattr(importlib.import_module(module), function)(**request["payload"])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _call_main() if sys.argv[1:] == ["--call"] else serve(sys.argv[1])
