"""The ``dead`` stream: bad input set aside with its reason, so nothing is lost and nothing blocks.

Every field is plain text: ``stream`` (the key the bad entry is in), ``entry`` (its id there), ``reason``
(what is wrong: which field, what was expected) and ``by`` (the process that found it). The bad entry itself
stays where it was; ``streamrl check`` counts bad entries that no dead letter names.

One dead letter per (stream, entry): one script sets ``dead:seen:<stream>:<entry>`` NX and appends only when
that marker was new, so a retried send, or a second process finding the same bad entry, adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol.keys import Keys
from shared.protocol.streams import codec, once

_SEND = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('XADD', KEYS[2], '*', 'stream', ARGV[2], 'entry', ARGV[3], 'reason', ARGV[4], 'by', ARGV[5])
end
return false
"""

FIELDS = ("stream", "entry", "reason", "by")


@dataclass(frozen=True)
class DeadLetter:
    stream: str
    entry: str
    reason: str
    by: str = ""


def send(client, keys: Keys, stream: str, entry_id, reason: str, by: str) -> bool:
    """Set (stream, entry) aside with ``reason``; False (a no-op, logged at debug) when it already was."""
    entry_id = codec.text(entry_id)
    added = client.eval(
        _SEND,
        2,
        keys.dead_lettered(stream, entry_id),
        keys.dead_letters,
        once.MARKER_TTL_S,
        stream,
        entry_id,
        reason,
        by,
    )
    if added is None:
        once.skipped("dead_letters", stream=stream, entry=entry_id)
    return added is not None


def decode(fields: dict) -> DeadLetter:
    f = {codec.text(k): codec.text(v) for k, v in fields.items()}
    return DeadLetter(f.get("stream", ""), f.get("entry", ""), f.get("reason", ""), f.get("by", ""))


def read_all(client, keys: Keys) -> list[DeadLetter]:
    return [decode(fields) for _, fields in client.xrange(keys.dead_letters)]
