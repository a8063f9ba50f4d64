"""A fault-injection TCP proxy for tests: between the services and the real Redis, on loopback only.

It forwards bytes both ways and, at random (seeded), injects one of two faults a retried command must survive:

- ``drop_reply``: the server's reply to a command is thrown away and the connection closed, AFTER the server
  executed it; the client sees a connection error and sends the command again.
- ``cut_request``: only a prefix of what the client sent (a pipeline, several commands) reaches the server,
  then the connection is closed: the server executed some of the pipeline, the client retries all of it.

``down()`` makes the server look really gone (every connection refused) until ``up()``. Bounded: at most
``max_connections`` connections, ``max_faults`` faults, 64 KiB per read; a background thread runs the loop.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter

LOOPBACK = ("127.0.0.1", "localhost", "::1")
CHUNK = 64 * 1024


class FaultProxy:
    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        drop_reply: float = 0.0,
        cut_request: float = 0.0,
        seed: int = 0,
        max_faults: int = 10_000,
        max_connections: int = 256,
    ):
        if upstream_host not in LOOPBACK:
            raise ValueError(f"fault proxy upstream {upstream_host!r}: expected a loopback address")
        self.upstream = (upstream_host, upstream_port)
        self.drop_reply, self.cut_request = drop_reply, cut_request
        self.rng = random.Random(seed)
        self.max_faults, self.max_connections = max_faults, max_connections
        self.faults: Counter = Counter()
        # chances to let pass before the next fault may be injected (to aim at one command)
        self.skip = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> FaultProxy:
        self._thread.start()
        self.up()
        return self

    def up(self) -> None:
        async def listen():
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
            self.port = self._server.sockets[0].getsockname()[1]

        asyncio.run_coroutine_threadsafe(listen(), self._loop).result(10)

    def down(self) -> None:
        """Refuse every connection and close the open ones: the server is gone, as far as clients can tell."""

        async def close():
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()
                self._server = None
            for w in list(self._writers):
                w.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)

    def stop(self) -> None:
        self.down()

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _fault(self, p: float, kind: str) -> bool:
        if p and self.skip > 0:
            self.skip -= 1
            return False
        if p and sum(self.faults.values()) < self.max_faults and self.rng.random() < p:
            self.faults[kind] += 1
            return True
        return False

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if len(self._writers) >= 2 * self.max_connections:
            client_w.close()
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        self._writers |= {client_w, server_w}

        def close_both():
            for w in (client_w, server_w):
                w.close()
                self._writers.discard(w)

        cut = []

        async def requests():
            while data := await client_r.read(CHUNK):
                if data.count(b"\r\n*") >= 1 and self._fault(self.cut_request, "request_cut"):
                    # a prefix of the pipeline
                    server_w.write(data[: self.rng.randrange(1, len(data))])
                    await server_w.drain()
                    # half-close: the server executes what it got, then hangs up
                    server_w.write_eof()
                    cut.append(True)
                    break
                server_w.write(data)
                await server_w.drain()

        async def replies():
            while data := await server_r.read(CHUNK):
                if self._fault(self.drop_reply, "reply_dropped"):
                    # executed by the server, never seen by the client
                    break
                client_w.write(data)
                await client_w.drain()

        tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(replies())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            # the cut request's prefix: closed only once the server has hung up (it ran what it got)
            if cut:
                await asyncio.wait([tasks[1]], timeout=10)
        except (ConnectionError, OSError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            close_both()
