"""The staleness gate in Redis: the one owner of the keys ``gate`` and ``gate:started``.

``gate`` is a hash {version, limit, max_staleness} that the syncer writes after each sync (``open``):
``limit`` is how many prompt groups may have been started in total under the rule of
``shared.protocol.staleness.group_capacity``. ``gate:started`` counts groups started so far:

- a rollout worker ``reserve``s slots before it claims that many groups (atomically: never past ``limit``),
  and ``refund``s the slots it reserved but did not use (fewer groups waiting, a dead-lettered entry);
- the trainer ``refund``s the slot of a group it will never train, so a replacement group may start.

No gate (the syncer has not opened it yet) means: everything may start in async mode, nothing in sync mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol.keys import Keys

_RESERVE = """
local limit = redis.call('HGET', KEYS[1], 'limit')
if not limit then return {-1, -1} end
local version = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
local started = tonumber(redis.call('GET', KEYS[2]) or '0')
local grant = math.min(tonumber(ARGV[1]), tonumber(limit) - started)
if grant <= 0 then return {0, version} end
redis.call('INCRBY', KEYS[2], grant)
return {grant, version}
"""


@dataclass(frozen=True)
class Grant:
    granted: int  # slots reserved now (to be refunded when not used)
    gated: bool  # False: no gate is open (granted is what was asked for in async mode, 0 in sync mode)
    version: int | None  # the version the gate was opened for, None when no gate


def open(client, keys: Keys, version: int, limit: int, max_staleness: int) -> None:
    """The syncer, after a sync: up to ``limit`` groups started in total may be running or trained."""
    client.hset(keys.gate, mapping={"version": version, "limit": limit, "max_staleness": max_staleness})


def opened_version(client, keys: Keys) -> int | None:
    v = client.hget(keys.gate, "version")
    return None if v is None else int(v)


def peek(client, keys: Keys) -> tuple[int | None, int | None]:
    """(version, limit) of the open gate, (None, None) when none is open. Reserves nothing."""
    version, limit = client.hmget(keys.gate, "version", "limit")
    return (None if version is None else int(version)), (None if limit is None else int(limit))


def started(client, keys: Keys) -> int:
    return int(client.get(keys.gate_started) or 0)


class Gate:
    """A rollout worker's handle: ``reserve`` before claiming groups, ``refund`` what was not used."""

    def __init__(self, client, keys: Keys, sync_mode: bool):
        self.client, self.keys, self.sync_mode = client, keys, sync_mode
        self._reserve = client.register_script(_RESERVE)

    def reserve(self, want: int) -> Grant:
        if want <= 0:
            return Grant(0, False, None)
        granted, version = (int(x) for x in self._reserve(keys=[self.keys.gate, self.keys.gate_started],
                                                          args=[want]))
        if granted < 0:
            return Grant(0 if self.sync_mode else want, False, None)
        return Grant(granted, True, version)

    def refund(self, n: int = 1) -> None:
        refund(self.client, self.keys, n)


def refund(client, keys: Keys, n: int = 1) -> None:
    """Give back ``n`` started slots: reserved and not used, or a started group that will never be trained."""
    if n > 0:
        client.decrby(keys.gate_started, n)
