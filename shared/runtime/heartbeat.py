"""The one heartbeat policy every process uses: a hash key ``alive:<service>:<worker>`` with a TTL.

A process calls ``beat()`` from its loop as often as it likes; the key is written at most every ``ttl / 3``
seconds (so two missed beats still leave it alive) and expires ``ttl`` seconds after the last write. Other
processes treat a missing key as a dead process. ``stop()`` deletes it on a warm stop. Each beat also adds the
worker to its service's registry set (``alive-registry:<service>``), so a service lists the live workers of
another (``alive_of``) without a SCAN; a member whose key has expired is dropped from it when listed.

A key that has not expired yet says nothing of a worker killed a moment ago: ``gone`` is the certain sign that comes
sooner, for a worker of this host. Its id (``new_worker_id``) names the host and the pid, and no process has that pid
any more (a supervisor reaps its children at once, so a dead worker is not left a zombie).
"""

from __future__ import annotations

import os
import socket
import time
import uuid

from shared.protocol.keys import Keys


class Heartbeat:
    def __init__(self, client, keys: Keys, service: str, worker_id: str, ttl: float):
        if ttl <= 0:
            raise ValueError(f"heartbeat ttl must be > 0 seconds, got {ttl}")
        self.client, self.ttl = client, ttl
        self.key = keys.alive(service, worker_id)
        self.registry, self.worker_id = keys.alive_registry(service), worker_id
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
        pipe.sadd(self.registry, self.worker_id)
        pipe.execute()
        return True

    def next_due(self) -> float:
        """When (time.monotonic) the next beat will write the key: a blocking wait should not outlast it."""
        return self._next

    def stop(self) -> None:
        pipe = self.client.pipeline()
        pipe.delete(self.key)
        pipe.srem(self.registry, self.worker_id)
        pipe.execute()


def is_alive(client, keys: Keys, service: str, worker_id: str) -> bool:
    return bool(client.exists(keys.alive(service, worker_id)))


def alive_of(client, keys: Keys, service: str) -> dict[str, dict[str, str]]:
    """{worker id: fields} of the live processes of one service, from its registry: one SMEMBERS and one pipeline
    of HGETALLs, whatever the size of the keyspace (a SCAN walks every episode stream). Registry members whose
    key has expired are dead: they are removed."""
    names = sorted(m.decode() for m in client.smembers(keys.alive_registry(service)))
    if not names:
        return {}
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.alive(service, name))
    out, dead = {}, []
    for name, fields in zip(names, pipe.execute()):
        if fields:
            out[name] = {k.decode(): v.decode() for k, v in fields.items()}
        else:
            dead.append(name)
    if dead:
        client.srem(keys.alive_registry(service), *dead)
    return out


def alive(client, keys: Keys, service: str = "*") -> dict[str, dict[str, str]]:
    """{"<service>:<worker>": fields} of every live process (of one service, or all): a SCAN, for tools that
    list everything; a service's loop uses ``alive_of``."""
    out = {}
    for key in client.scan_iter(match=keys.alive_pattern(service), count=10_000):
        fields = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
        if fields:
            out[keys.alive_name(key)] = fields
    return out


def new_worker_id(service: str) -> str:
    """``<service>-<host>-<pid>-<4 hex>``: unique, and it says where the process runs (``gone`` reads it)."""
    return f"{service}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def gone(worker_id: str) -> bool:
    """True only when certain that the worker is dead: its id is ``new_worker_id``'s of this host and no process has
    its pid. Any doubt (another host, an id of another form, the pid in use, perhaps by another process) is False:
    the heartbeat's expiry decides then."""
    rest, _, suffix = worker_id.rpartition("-")
    head, _, pid = rest.rpartition("-")
    if not (suffix and pid.isdigit() and head.endswith(f"-{socket.gethostname()}")):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False
