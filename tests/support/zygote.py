"""A warm process starter for the tests: ``python -m module args`` without paying ``import torch`` each time.

Each service process a test starts used to spend ~2.5 CPU-seconds importing torch and transformers before its
first line of work, and the drills start hundreds of them on a 2-core box. The zygote is one process per pytest
worker that imports those third-party libraries once, then serves requests on a Unix socket: each request
forks a child that becomes the requested process — its own session (``kill9`` takes its group), its own
stdout/stderr (file descriptors passed over the socket), the environment, working directory and ``sys.argv``
the test asked for — and runs the module with ``runpy`` as ``python -m`` does. The project's own modules are
NOT pre-imported: the child imports them under its own environment, as a fresh interpreter would, so a config
or crash point read from the environment at import time sees the test's values. This is how gunicorn's
``--preload`` and PyTorch's fork-started DataLoader workers start processes; torch registers fork handlers for
its thread pools. (pyarrow is left out: its allocator starts a background thread at import.)

The zygote reaps its children and reports each exit status on the connection that asked for it, so the
test-side handle (``procs.Warm``) answers ``poll``, ``wait``, ``returncode`` like ``subprocess.Popen``.
Set ``TESTS_COLD_START=1`` to start every process with a fresh interpreter instead.

Protocol (SOCK_SEQPACKET, one message each way per step): the request is JSON
``{"module", "args", "env", "cwd"}`` with two file descriptors (stdout, stderr) attached; the zygote answers
``{"pid": N}`` and, when that child exits, ``{"code": C}`` (``Popen.returncode``'s convention: -N for signal N).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

PRELOAD = ("torch", "numpy", "redis", "rq", "msgpack", "structlog", "safetensors", "zstandard", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2", "uvicorn",
           "fastapi", "httpx")
MAX_MESSAGE = 1 << 20


def preload() -> None:
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (fills transformers' lazy maps)


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested process and run it; never returns."""
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM):  # SIGPIPE stays ignored, as Python sets it
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
        _name_process(request["module"])
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
            sys.excepthook(*sys.exc_info())  # a service's own hook, as the interpreter would call it
            code = 1
        import threading
        threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads
        import atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def _name_process(module: str) -> None:
    """``ps``/``top`` show the module's last part (its comm name) instead of the zygote's."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, module.rsplit(".", 1)[-1][:15].encode(), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def serve(path: str) -> None:
    preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([server, wake_r, sys.stdin], [], [])
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            return  # the pytest worker that started us is gone
        if server in readable:
            conn, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                server.close()
                os.close(wake_r)
                os.close(wake_w)
                for other in waiting.values():
                    other.close()
                conn.close()
                _child(request, fds)
            for fd in fds:
                os.close(fd)
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


if __name__ == "__main__":
    serve(sys.argv[1])
