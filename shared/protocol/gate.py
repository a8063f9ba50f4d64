"""The staleness gate in Redis: the one owner of the keys ``gate`` and ``gate:started``.

``gate`` is a hash {version, limit, max_staleness, per_version, complete} that the syncer writes after each
sync (``open``): ``limit`` is how many prompt groups may have been started in total under the rule of
``shared.protocol.staleness.group_capacity``; ``complete`` the newest version every live worker has loaded (a
rolling sync opens the gate after its first wave, and marks it complete after its last). ``gate:started``
counts groups started so far:

- a rollout worker ``reserve``s slots before it claims that many groups (atomically: never past ``limit``);
  in an agent run the driver reserves a group's slot before it hands the group to the agents workers,
  and ``refund``s the slots it reserved but did not use (fewer groups waiting, a dead-lettered entry);
- the trainer ``refund``s the slot of a group it will never train, so a replacement group may start.

No gate (the syncer has not opened it yet) means: everything may start in async mode, nothing in sync mode.

Every reservation and refund carries a token (random per call, or the group id for the trainer's refund of a
group) and records its outcome under ``gate:req:<token>`` in the same script: a call repeated (a retried
command whose reply was lost, a trainer re-judging a group after a restart) returns the first outcome and
changes nothing, so slots neither leak nor are given back twice. A call's own random token guards only a retry of
that call and lives ``once.RETRY_MARKER_TTL_S``; a named token (a group's, guarding a restart) ``REQUEST_TTL_S``.

What the gate promises: at most ``limit`` = (η + v + 1)·B groups are ever started (net of refunds) while the gate is
at version v, and a worker still running an older version w reserves only under ITS version's limit, (η + w + 1)·B,
so a group's start rank is bounded by the version that generates it whichever version the gate is at: a rolling sync
can open the gate as soon as one worker runs the new version. When the trainer consumes groups in start order that
bounds staleness by η (``shared.protocol.staleness.group_capacity``). The trainer reads in FINISH order: a group that
started early and finishes late is trained later than its start rank says, so the bound on the admission count is all
the gate guarantees then. The trainer does not throw such a late group away: it trains it with the importance weights
of docs/training.md (tokens past ``hard_max_staleness`` masked and counted), and refunds the slot only of a group it
never trains. tests/protocol/test_gate.py checks the admission bound under finish order."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from shared.protocol.keys import Keys
from shared.protocol.streams import once

# how long a NAMED reservation's or refund's outcome is kept (``group:<id>``: a restart's repeat)
REQUEST_TTL_S = 600
# A call's own token (none given: a uuid per call) guards only a retry of that call, within ``redis_wait``: its
# outcome is kept ``once.RETRY_MARKER_TTL_S`` (120 s), not 600 s (nearly every gate:req key is one of these)

_RESERVE = """
local done = redis.call('GET', KEYS[3])
if done then return {-2, tonumber(done)} end
local limit = redis.call('HGET', KEYS[1], 'limit')
if not limit then return {-1, -1} end
limit = tonumber(limit)
local version = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
local per_version = tonumber(redis.call('HGET', KEYS[1], 'per_version') or '0')
local worker_version = tonumber(ARGV[3])
if worker_version >= 0 and worker_version < version then
  limit = limit - (version - worker_version) * per_version  -- the limit of the worker's own version
end
local started = tonumber(redis.call('GET', KEYS[2]) or '0')
local grant = math.min(tonumber(ARGV[1]), limit - started)
if grant <= 0 then return {0, version} end
redis.call('INCRBY', KEYS[2], grant)
redis.call('SET', KEYS[3], grant, 'EX', ARGV[2])
return {grant, version}
"""

_REFUND = """
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'EX', ARGV[2]) then
  return redis.call('DECRBY', KEYS[1], ARGV[1])
end
return false
"""


def ttl_of(token: str | None) -> int:
    """How long a request's outcome is kept: a named token's (a restart may repeat it) ``REQUEST_TTL_S``, a call's
    own (None: only a retry of that call repeats it) ``once.RETRY_MARKER_TTL_S``."""
    return REQUEST_TTL_S if token else once.RETRY_MARKER_TTL_S


@dataclass(frozen=True)
class Grant:
    # slots reserved now (to be refunded when not used)
    granted: int
    # False: no gate is open (granted is what was asked for in async mode, 0 in sync mode)
    gated: bool
    # the version the gate was opened for, None when no gate
    version: int | None


def open(
    client, keys: Keys, version: int, limit: int, max_staleness: int, per_version: int = 0, complete: bool = True
) -> None:
    """The syncer, after a sync: up to ``limit`` groups started in total may be running or trained; a worker on an
    older version w reserves under ``limit`` - (version - w) x ``per_version`` (the groups the trainer takes per
    version). ``complete``: every live worker runs ``version`` (a rolling sync: after its last wave)."""
    fields = {"version": version, "limit": limit, "max_staleness": max_staleness, "per_version": per_version}
    client.hset(keys.gate, mapping={**fields, **({"complete": version} if complete else {})})


def mark_complete(client, keys: Keys, version: int) -> None:
    """A rolling sync's last wave has loaded ``version``: every live worker runs it."""
    client.hset(keys.gate, "complete", version)


def complete_version(client, keys: Keys) -> int | None:
    v = client.hget(keys.gate, "complete")
    return None if v is None else int(v)


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

    def reserve(self, want: int, token: str | None = None, version: int | None = None) -> Grant:
        """Reserve up to ``want`` slots. ``token`` names the reservation (default: this call only): the driver of
        an agent run reserves its group's slot as ``group:<id>``, so a restarted driver reserves it once.
        ``version``: the reserving worker's; behind the gate's, it reserves under its own version's limit."""
        if want <= 0:
            return Grant(0, False, None)
        ttl = ttl_of(token)
        token = token or uuid.uuid4().hex
        granted, version = (
            int(x)
            for x in self._reserve(
                keys=[self.keys.gate, self.keys.gate_started, self.keys.gate_request(token)],
                args=[want, ttl, -1 if version is None else version],
            )
        )
        # this very call ran before (a retry): the slots it reserved then are this call's
        if granted == -2:
            once.skipped("gate reserve", token=token, granted=version)
            granted, version = version, opened_version(self.client, self.keys)
            return Grant(granted, True, version)
        if granted < 0:
            return Grant(0 if self.sync_mode else want, False, None)
        return Grant(granted, True, version)

    def refund(self, n: int = 1) -> None:
        refund(self.client, self.keys, n)


def refund_group(client, keys: Keys, group_id: str) -> bool:
    """The trainer: give back the slot of a group it will never train, once per group (a restart that judges
    the same group again gives nothing back twice)."""
    return refund(client, keys, 1, token=f"group:{group_id}")


def refund(client, keys: Keys, n: int = 1, token: str | None = None) -> bool:
    """Give back ``n`` started slots: reserved and not used, or a started group that will never be trained.
    At most once per ``token`` (default: a new one, i.e. this call only): False when already refunded."""
    if n <= 0:
        return False
    ttl = ttl_of(token)
    token = token or uuid.uuid4().hex
    if client.eval(_REFUND, 2, keys.gate_started, keys.gate_request(f"refund:{token}"), n, ttl) is None:
        once.skipped("gate refund", token=token, n=n)
        return False
    return True
