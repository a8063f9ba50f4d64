"""How long an XREAD BLOCK of N ms really waits on the embedded server at hz 10 (Valkey's default) and hz 100
(what `EmbeddedRedis` runs with), and what the higher hz costs an idle server in CPU. Usage:

    python bench/redis_hz.py

A blocking read returns at once when an entry arrives, whatever hz; hz only decides how late a TIMEOUT fires
(the server checks blocked clients' deadlines hz times a second). streamrl's loops wake on events, so their
timeouts are timers (heartbeats, reports), but a late timeout still delays those.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402


def server_cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().split(")")[1].split()
    return int(fields[11]) + int(fields[12])


def main() -> None:
    for hz in (10, 100):
        with tempfile.TemporaryDirectory() as folder:
            server = EmbeddedRedis(folder).start()
            client = redis.Redis.from_url(server.url)
            client.config_set("hz", hz)
            for block in (10, 50, 100, 200):
                waits = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    client.xread({"nothing": "$"}, block=block)
                    waits.append((time.perf_counter() - t0) * 1000)
                median = sorted(waits)[2]
                print(
                    f"hz {hz:3d}: XREAD BLOCK {block:3d} returned after {median:6.1f} ms (median of 5; "
                    f"x {median / block:.2f} of the timeout)"
                )
            before = server_cpu_ticks(server.proc.pid)
            time.sleep(3)
            print(f"hz {hz:3d}: idle server CPU {(server_cpu_ticks(server.proc.pid) - before) / 3:.2f}% of one core")
            server.stop()


if __name__ == "__main__":
    main()
