"""A real 3-master Redis Cluster on loopback, for tests and benchmarks: ``LocalCluster(tmp).start()``.

Three valkey-server processes (the binary ``EmbeddedRedis`` uses) with ``--cluster-enabled yes``, each on a
free loopback port with its own folder, no replicas. The 16384 slots are split in three (CLUSTER ADDSLOTSRANGE),
the nodes are introduced (CLUSTER MEET), and ``start`` returns once every node reports ``cluster_state:ok`` and
knows all three masters. ``url`` is the ``redis+cluster://`` URL streamrl's ``connect`` takes; ``stop`` ends
the three processes (SIGTERM, then kill -9).
"""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack
from pathlib import Path

import redis

from services.ops.launch.redis_server import EmbeddedRedis, ServerError

SLOTS = 16384


def _free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once, so none is handed out twice)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


class ClusterNode(EmbeddedRedis):
    """One cluster-enabled server: its cluster state file (nodes.conf) lives in its own folder; its cluster bus
    gets a free port of its own (the default, port + 10000, is past 65535 for many free ports)."""

    def __init__(self, data_dir, port: int, bus_port: int, **kwargs):
        super().__init__(data_dir, port=port, **kwargs)
        self.bus_port = bus_port

    def command(self) -> list[str]:
        cmd = super().command() + [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
            "--cluster-port",
            str(self.bus_port),
        ]
        if self.password:
            cmd += ["--masterauth", self.password]
        return cmd


class LocalCluster:
    def __init__(self, data_dir: str | Path, masters: int = 3, password: str | None = None, host: str = "127.0.0.1"):
        if masters < 1:
            raise ValueError(f"a cluster needs at least 1 master, got masters={masters}")
        self.data_dir, self.password, self.host = Path(data_dir), password, host
        ports = _free_ports(host, 2 * masters)
        self.nodes = [
            ClusterNode(self.data_dir / f"node{i}", ports[2 * i], ports[2 * i + 1], host=host, password=password)
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        """The cluster URL of the first node (a client discovers the others from it)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis+cluster://{auth}{self.host}:{self.nodes[0].port}"

    @property
    def node_urls(self) -> list[str]:
        """Plain ``redis://`` URLs of each node (for per-node inspection)."""
        return [n.url for n in self.nodes]

    def start(self, timeout: float = 30.0) -> "LocalCluster":
        try:
            for node in self.nodes:
                node.start()
            clients = [redis.Redis.from_url(n.url, decode_responses=True) for n in self.nodes]
            per = SLOTS // len(self.nodes)
            for i, c in enumerate(clients):
                last = SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * per - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", node.host, node.port, node.bus_port)
            deadline = time.monotonic() + timeout
            while not all(self._ready(c) for c in clients):
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"the {len(self.nodes)}-node cluster in {self.data_dir} did not reach "
                        f"cluster_state:ok within {timeout:g} s"
                    )
                time.sleep(0.05)
            for c in clients:
                c.close()
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self, client: redis.Redis) -> bool:
        info = client.execute_command("CLUSTER", "INFO")
        info = dict(line.split(":", 1) for line in info.strip().splitlines() if ":" in line)
        return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == len(self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
