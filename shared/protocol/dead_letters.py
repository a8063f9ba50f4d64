"""The ``dead`` stream: bad input set aside with its reason, so nothing is lost and nothing blocks.

Every field is plain text: ``stream`` (the key the bad entry is in), ``entry`` (its id there), ``reason``
(what is wrong: which field, what was expected) and ``by`` (the process that found it). The bad entry itself
stays where it was; ``streamrl check`` counts bad entries that no dead letter names.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol.keys import Keys

FIELDS = ("stream", "entry", "reason", "by")


@dataclass(frozen=True)
class DeadLetter:
    stream: str
    entry: str
    reason: str
    by: str = ""


def _s(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def send(client, keys: Keys, stream: str, entry_id, reason: str, by: str) -> None:
    client.xadd(keys.dead_letters, {"stream": stream, "entry": _s(entry_id), "reason": reason, "by": by})


def decode(fields: dict) -> DeadLetter:
    f = {_s(k): _s(v) for k, v in fields.items()}
    return DeadLetter(f.get("stream", ""), f.get("entry", ""), f.get("reason", ""), f.get("by", ""))


def read_all(client, keys: Keys) -> list[DeadLetter]:
    return [decode(fields) for _, fields in client.xrange(keys.dead_letters)]
