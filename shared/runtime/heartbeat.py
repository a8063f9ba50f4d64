"""The one heartbeat policy every process uses: a hash key ``alive:<service>:<worker>`` with a TTL.

A process calls ``beat()`` from its loop as often as it likes; the key is written at most every ``ttl / 3``
seconds (so two missed beats still leave it alive) and expires ``ttl`` seconds after the last write. Other
processes treat a missing key as a dead process. ``stop()`` deletes it on a warm stop.
"""

from __future__ import annotations

import time

from shared.protocol.keys import Keys


class Heartbeat:
    def __init__(self, client, keys: Keys, service: str, worker_id: str, ttl: float):
        if ttl <= 0:
            raise ValueError(f"heartbeat ttl must be > 0 seconds, got {ttl}")
        self.client, self.ttl = client, ttl
        self.key = keys.alive(service, worker_id)
        self._next = 0.0

    def beat(self, force: bool = False, **fields) -> bool:
        """Refresh the key (and its fields) when due or ``force``d; True when it was written."""
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.ttl / 3
        pipe = self.client.pipeline()
        pipe.hset(self.key, mapping={"time": time.time(), **{k: str(v) for k, v in fields.items()}})
        pipe.pexpire(self.key, int(self.ttl * 1000))
        pipe.execute()
        return True

    def next_due(self) -> float:
        """When (time.monotonic) the next beat will write the key: a blocking wait should not outlast it."""
        return self._next

    def stop(self) -> None:
        self.client.delete(self.key)


def is_alive(client, keys: Keys, service: str, worker_id: str) -> bool:
    return bool(client.exists(keys.alive(service, worker_id)))


def alive(client, keys: Keys, service: str = "*") -> dict[str, dict[str, str]]:
    """{"<service>:<worker>": fields} of every live process (of one service, or all)."""
    out = {}
    for key in client.scan_iter(match=keys.alive_pattern(service), count=10_000):
        fields = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
        if fields:
            out[keys.alive_name(key)] = fields
    return out
