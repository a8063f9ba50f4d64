"""The weight server: published versions over HTTP, for rollout workers that share no filesystem with the trainer.

    GET  /weights/v000007.safetensors     the file (Range requests answered 206 with Content-Range; If-Range)
    HEAD /weights/v000007.safetensors     its headers only
    GET  /weights/v000007.delta           its delta against v000006 (404 for a snapshot version)

Every answer for a file carries ``ETag: "<sha256 hex>"`` and ``Repr-Digest: sha-256=:<base64>:`` (RFC 9530), so a
client can check the digest before it downloads and resume with ``If-Range``. Only names of published versions
(``v<digits>.safetensors``) directly in the served folder are answered; anything else is 404, so nothing outside the
folder can be reached. With a token, a request without ``Authorization: Bearer <token>`` gets 401.

The transfer itself (ranges, HEAD, conditional requests) is starlette's ``FileResponse`` served by uvicorn in a
thread. The server holds no state beyond a digest cache keyed by (name, size, mtime, inode): any process holding a
verified copy of a version can serve it with this same class (a relay: a rollout worker that serves its neighbours in
the relay tree)."""

from __future__ import annotations

import base64
import hmac
import re
import socket
import threading
import time
from pathlib import Path

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Route

from shared.runtime.weights.checksum import sha256_file

# what publish.write_weights names a version's file
NAME = re.compile(r"v\d{6,}\.safetensors")
# a version's delta against the version before (services/trainer/publisher.py)
DELTA = re.compile(r"v\d{6,}\.delta")
PREFIX = "/weights/"


def file_name(version: int) -> str:
    """The file name of ``version`` in a published folder and on the server (``/weights/<name>``)."""
    return f"v{version:06d}.safetensors"


def delta_name(version: int) -> str:
    """The name of ``version``'s delta against ``version - 1`` (shared/protocol/weights/delta.py), beside its file."""
    return f"v{version:06d}.delta"


def etag(sha256_hex: str) -> str:
    """The ETag of a served file: its sha256, quoted (what a client's If-Range sends back)."""
    return f'"{sha256_hex}"'


class _File(FileResponse):
    # starlette's 64 KiB makes a GB file thousands of sends
    chunk_size = 1 << 20


class Digests:
    """sha256 of the served files, computed once per file (a new file under the same name is hashed again)."""

    def __init__(self):
        self._lock, self._known = threading.Lock(), {}

    def of(self, path: Path, st) -> str:
        key = (path.name, st.st_size, st.st_mtime_ns, st.st_ino)
        # one hash per file even when every worker asks at once
        with self._lock:
            if key not in self._known:
                self._known = {k: v for k, v in self._known.items() if k[0] != path.name}
                self._known[key] = sha256_file(path)
            return self._known[key]


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path``, its links followed, is in ``folder`` (its links followed too)."""
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def make_app(directory: str | Path, token: str = "", resolve=None) -> Starlette:
    """``resolve(name) -> (Path, sha256 hex) | None`` (a relay: a rollout worker's verified copies, wherever they
    are, with the digest it verified them against: not hashed again) replaces the lookup of ``name`` in
    ``directory``; it runs in a worker thread and may block (a relay waiting for a copy it is fetching)."""
    folder = Path(directory)
    digests = Digests()

    async def weights(request: Request) -> Response:
        # as it came (any bytes: no 500)
        sent = request.headers.get("authorization", "").encode("latin-1")
        if token and not hmac.compare_digest(sent, f"Bearer {token}".encode()):
            return PlainTextResponse(
                "authorization: missing or wrong bearer token (config weights_token)\n",
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        name = request.path_params["name"]
        if not NAME.fullmatch(name) and not DELTA.fullmatch(name):
            return PlainTextResponse(
                f"{name!r} is not a published version's file name (v<NNNNNN>.safetensors, "
                f"or its delta v<NNNNNN>.delta)\n",
                404,
            )
        # a relay's resolve may wait for a copy still on its way (sync_mode pull): in a thread, not on the loop
        path, digest = (
            (folder / name, None)
            if resolve is None
            else (await anyio.to_thread.run_sync(resolve, name) or (None, None))
        )
        try:
            st = path.stat() if path is not None else None
        except OSError:
            st = None
        if st is None or not path.is_file():
            return PlainTextResponse(f"no {name} here (not published yet, or pruned)\n", 404)
        # a symlink out of the folder: not served
        if resolve is None and not _inside(path, folder):
            return PlainTextResponse(f"{name} is a link out of the served folder; not served\n", 404)
        if digest is None:
            digest = await anyio.to_thread.run_sync(digests.of, path, st)
        headers = {
            "etag": etag(digest),
            "repr-digest": f"sha-256=:{base64.b64encode(bytes.fromhex(digest)).decode()}:",
            "cache-control": "no-transform",
        }
        return _File(path, headers=headers, media_type="application/octet-stream", stat_result=st)

    return Starlette(routes=[Route(PREFIX + "{name}", weights, methods=["GET", "HEAD"])])


class _Counted:
    """The app, counting the file bytes it sends (bodies of 200 and 206 answers: what its uplink carried of weights)."""

    def __init__(self, app):
        self.app, self.sent_bytes = app, 0

    async def __call__(self, scope, receive, send):
        status = 0

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status in (200, 206):
                self.sent_bytes += len(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, counted)


class WeightServer:
    """``make_app`` served by uvicorn in a daemon thread of this process. ``start()`` binds first, so an address in
    use is a clear error at once; ``port=0`` takes a free port (``.port`` / ``.url`` say which)."""

    def __init__(
        self,
        directory: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        resolve=None,
        config_keys: str = "weights_host, weights_port",
    ):
        self.directory, self.host, self.port, self.token = Path(directory), host, port, token
        self.resolve, self.config_keys = resolve, config_keys
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._app: _Counted | None = None

    @property
    def sent_bytes(self) -> int:
        """File bytes sent since start."""
        return self._app.sent_bytes if self._app else 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def url_of(self, version: int) -> str:
        return f"{self.url}{PREFIX}{file_name(version)}"

    def start(self, timeout: float = 30.0) -> "WeightServer":
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(
                f"weight server: cannot listen on {self.host}:{self.port} (config "
                f"{self.config_keys}): {exc.strerror or exc}"
            ) from None
        self.port = sock.getsockname()[1]
        self._app = _Counted(make_app(self.directory, self.token, self.resolve))
        config = uvicorn.Config(
            self._app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name="weight-server"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        # uvicorn sets it once it accepts connections (start-up, not a sync)
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"weight server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None
