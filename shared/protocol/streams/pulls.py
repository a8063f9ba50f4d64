"""Weights pulled by the workers (``sync_mode = pull``): the load lease and the ``pulls`` stream.

The lease caps how many rollout workers load a version at once (``max_loading``): a sorted set ``load-lease``,
member = worker id, score = when its lease expires (milliseconds, the server's clock: ``TIME``). ``acquire``
first drops every expired lease (a worker killed -9 while it held one blocks the others ``load_lease_s`` at
most), then grants one when fewer than ``max_loading`` are held (a worker asking again while it holds one renews
it); ``release`` gives it back. Both scripts append to the ``pulls`` stream in the same step, so the stream is an
exact record of who held the lease when (tests replay it), and a worker waiting for the lease wakes on the
release instead of polling. A worker also appends ``fetched`` when its download of a version is verified.

``pulls`` entries, every field plain text: ``event`` (fetched | acquired | released | expired), ``worker``,
``version``, ``holders`` (acquired, released: how many held the lease right after), and per event:
``source`` (fetched: trainer | relay | local), ``seconds`` (fetched: the download), ``reason`` (acquired: what
the load policy said, services/rollout/weights/load_policy.py), ``announced_s`` (released: seconds from the version's
publish to loaded), ``paused_s`` (released: the worker's pause for the load).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol.episode.errors import EventError
from shared.protocol.keys import Keys
from shared.protocol.streams import codec

# entries kept (approximate trim): a record and a wake-up
MAXLEN = 10_000
EVENTS = ("fetched", "acquired", "released", "expired")

_ACQUIRE = """
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, w in ipairs(gone) do
  redis.call('ZREM', KEYS[1], w)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'event', 'expired', 'worker', w, 'version', '-1')
end
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
local n = redis.call('ZCARD', KEYS[1])
if not held and n >= tonumber(ARGV[3]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, n, tonumber(first[2]) - now}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[1])
if not held then
  n = n + 1
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'event', 'acquired', 'worker', ARGV[1], 'version',
             ARGV[2], 'holders', n, unpack(ARGV, 6))
end
return {1, n, 0}
"""

_RELEASE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return false end
local n = redis.call('ZCARD', KEYS[1])
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'event', 'released', 'worker', ARGV[1], 'version',
                  ARGV[2], 'holders', n, unpack(ARGV, 4))
"""


@dataclass(frozen=True)
class Lease:
    granted: bool
    # leases held right after (with this one when granted)
    holders: int
    # refused: seconds until the first held lease expires (the latest a retry is useful)
    retry_s: float = 0.0


@dataclass(frozen=True)
class Pull:
    event: str
    worker: str
    version: int
    holders: int = -1
    # the event's other fields (source, seconds, reason, ...), as text
    extra: dict = field(default_factory=dict)
    entry_id: str = ""


def _flat(fields: dict) -> list[str]:
    return [str(x) for kv in fields.items() for x in kv]


def acquire(client, keys: Keys, worker: str, version: int, max_loading: int, lease_s: float, **fields) -> Lease:
    """A load lease for ``worker`` (to load ``version``), valid ``lease_s`` seconds, unless ``max_loading`` others
    hold one. ``fields`` go into the ``acquired`` entry."""
    granted, holders, retry_ms = client.eval(
        _ACQUIRE,
        2,
        keys.load_lease,
        keys.pulls,
        worker,
        version,
        max_loading,
        int(lease_s * 1000),
        MAXLEN,
        *_flat(fields),
    )
    return Lease(bool(int(granted)), int(holders), max(0.0, int(retry_ms) / 1000))


def release(client, keys: Keys, worker: str, version: int, **fields) -> bool:
    """Give ``worker``'s lease back (``fields`` into the ``released`` entry); False when it held none (expired)."""
    return client.eval(_RELEASE, 2, keys.load_lease, keys.pulls, worker, version, MAXLEN, *_flat(fields)) is not None


def holders(client, keys: Keys) -> list[str]:
    """The workers holding a lease now (expired ones included until the next ``acquire``)."""
    return sorted(m.decode() for m in client.zrange(keys.load_lease, 0, -1))


def fetched(client, keys: Keys, worker: str, version: int, source: str, seconds: float) -> str:
    return codec.text(
        client.xadd(
            keys.pulls,
            {"event": "fetched", "worker": worker, "version": version, "source": source, "seconds": f"{seconds:.3f}"},
            maxlen=MAXLEN,
            approximate=True,
        )
    )


def decode(entry_id, fields: dict) -> Pull:
    entry_id = codec.text(entry_id)
    f = {codec.text(k): codec.text(v) for k, v in fields.items()}
    if f.get("event") not in EVENTS:
        raise EventError(entry_id, "event", f"expected one of {', '.join(EVENTS)}, got {f.get('event')!r}")
    if not f.get("worker"):
        raise EventError(entry_id, "worker", "missing worker id")
    try:
        version, held = int(f.get("version", "-1")), int(f.get("holders", "-1"))
    except ValueError:
        raise EventError(
            entry_id,
            "version",
            f"expected integers version and holders, got {f.get('version')!r}, {f.get('holders')!r}",
        ) from None
    extra = {k: v for k, v in f.items() if k not in ("event", "worker", "version", "holders")}
    return Pull(f["event"], f["worker"], version, held, extra, entry_id)


def decode_entries(entries) -> list[Pull]:
    """Entries of an XREAD / XRANGE reply; a malformed one is skipped (the stream is a record, not a command)."""
    out = []
    for entry_id, fields in entries:
        try:
            out.append(decode(entry_id, fields))
        except EventError:
            continue
    return out


def read_all(client, keys: Keys) -> list[Pull]:
    return decode_entries(client.xrange(keys.pulls))


def last_id(client, keys: Keys) -> str:
    last = client.xrevrange(keys.pulls, count=1)
    return codec.text(last[0][0]) if last else "0-0"


def most_holders(records: list[Pull]) -> int:
    """From the order of the pulls record alone (no clocks): a worker holds the lease from its ``acquired`` entry to
    its ``released`` or ``expired`` one; the most holders at any point (what ``max_loading`` caps)."""
    held, most = set(), 0
    for p in records:
        if p.event == "acquired":
            held.add(p.worker)
        elif p.event in ("released", "expired"):
            held.discard(p.worker)
        most = max(most, len(held))
    return most
