"""CPU accounting for the scale-out benchmarks (Linux /proc, no extra package): CPU seconds of given processes,
of the whole box, and of the Redis server(s) (INFO cpu: one node, or every node of a cluster client)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """user + system CPU seconds of one process (0 when it has gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    # utime, stime (fields 14 and 15 of stat)
    return (int(fields[11]) + int(fields[12])) / TICK


def box_cpu_s() -> float:
    """Busy CPU seconds of the whole box since boot (every core; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    # user nice system idle iowait irq softirq steal (guest is inside user)
    return (sum(vals[:8]) - idle) / TICK


def server_cpu_s(client) -> dict[str, float]:
    """{node: CPU seconds (user + sys, all threads)} of the Redis server behind ``client``: one entry for a
    plain client, one per primary for a cluster client (redis-py's RedisCluster sends INFO to one node unless
    told which)."""
    if hasattr(client, "get_primaries"):
        info = client.info("cpu", target_nodes=client.PRIMARIES)
    else:
        info = client.info("cpu")
    if "used_cpu_user" in info:
        return {"server": float(info["used_cpu_user"]) + float(info["used_cpu_sys"])}
    return {
        str(node): float(v["used_cpu_user"]) + float(v["used_cpu_sys"])
        for node, v in info.items()
        if isinstance(v, dict) and "used_cpu_user" in v
    }


@dataclass
class Snapshot:
    t: float
    box: float
    procs: dict[int, float]
    server: dict[str, float]


def snapshot(pids=(), client=None) -> Snapshot:
    return Snapshot(
        time.monotonic(),
        box_cpu_s(),
        {pid: process_cpu_s(pid) for pid in pids},
        server_cpu_s(client) if client is not None else {},
    )


def cores(a: Snapshot, b: Snapshot) -> dict:
    """Average cores used between two snapshots: box (everything on it), procs (the given processes together),
    server (all nodes together) and server_max (the busiest node)."""
    dt = max(b.t - a.t, 1e-9)
    server = {n: (b.server[n] - a.server.get(n, 0.0)) / dt for n in b.server}
    return {
        "box": (b.box - a.box) / dt,
        "procs": sum(b.procs[p] - a.procs.get(p, 0.0) for p in b.procs) / dt,
        "server": sum(server.values()),
        "server_max": max(server.values(), default=0.0),
    }


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
