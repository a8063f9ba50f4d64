"""The ``repacks`` stream: long-tail groups handed from one rollout worker to a long-tail worker.

A repack moves a prompt group's pending entry (in the ``rollout`` consumer group of its prompts stream) from
the worker that held it to another, and says so on this stream in the same script: the entry changes owner
only if it is still pending under the source (``handoff``: fenced on the owner, so a source that another
worker has already taken the group from hands over nothing), and the notice is appended atomically with the
change, so a target that reads the notice finds the entry pending under itself. Both keys carry the run's hash
tag: the script is cluster-safe. A retried handoff whose first execution's reply was lost finds the entry
under the target and is a no-op (False), which the source treats like a handed group: it forgets it.

Every field is plain text: ``stream`` (the prompts stream of the group), ``entry`` (its entry id there),
``group`` (group id), ``source`` and ``target`` (worker ids), ``episodes`` (episodes moved, still
generating), ``tokens`` (their generated tokens so far), ``step_ms`` (the source's mean engine step time:
the target's estimate of the time the repack saved the source).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol.episode.errors import EventError
from shared.protocol.keys import ROLLOUT_GROUP, Keys
from shared.protocol.streams import codec

# notices kept (approximate trim): the stream is a wake-up and a record, the PEL is the truth
MAXLEN = 10_000

_HANDOFF = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then
  return false
end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[4], 0, ARGV[2])
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(ARGV, 6))
"""

FIELDS = ("stream", "entry", "group", "source", "target", "episodes", "tokens", "step_ms")


@dataclass(frozen=True)
class Repack:
    stream: str
    entry: str
    group: str
    source: str
    target: str
    episodes: int = 0
    tokens: int = 0
    step_ms: float = 0.0
    # the notice's id in the repacks stream (set when read)
    notice_id: str = ""


def encode(r: Repack) -> dict[str, str]:
    return {
        "stream": r.stream,
        "entry": r.entry,
        "group": r.group,
        "source": r.source,
        "target": r.target,
        "episodes": str(r.episodes),
        "tokens": str(r.tokens),
        "step_ms": f"{r.step_ms:.3f}",
    }


def decode(entry_id, fields: dict) -> Repack:
    """A notice from its stream entry; EventError naming the entry and the field when malformed."""
    entry_id = codec.text(entry_id)
    f = {codec.text(k): codec.text(v) for k, v in fields.items()}
    for name in FIELDS:
        if not f.get(name):
            raise EventError(entry_id, name, "missing (a repack notice needs " + ", ".join(FIELDS) + ")")
    try:
        episodes, tokens = int(f["episodes"]), int(f["tokens"])
    except ValueError:
        raise EventError(
            entry_id, "episodes/tokens", f"expected integers, got {f['episodes']!r}, {f['tokens']!r}"
        ) from None
    try:
        step_ms = float(f["step_ms"])
    except ValueError:
        raise EventError(entry_id, "step_ms", f"expected a number, got {f['step_ms']!r}") from None
    return Repack(f["stream"], f["entry"], f["group"], f["source"], f["target"], episodes, tokens, step_ms, entry_id)


def handoff(client, keys: Keys, r: Repack) -> str | None:
    """Move the group's pending entry from ``r.source`` to ``r.target`` and append the notice, atomically; the
    notice's id, or None when the entry was not pending under the source (another worker holds it now)."""
    flat = [x for kv in encode(r).items() for x in kv]
    added = client.eval(_HANDOFF, 2, r.stream, keys.repacks, ROLLOUT_GROUP, r.entry, r.source, r.target, MAXLEN, *flat)
    return codec.text(added) if added is not None else None


def last_id(client, keys: Keys) -> str:
    """The newest notice's id ("0-0" when none): a reader starting now reads only what comes after."""
    last = client.xrevrange(keys.repacks, count=1)
    return codec.text(last[0][0]) if last else "0-0"


def read_all(client, keys: Keys) -> tuple[list[Repack], list[tuple[str, str]]]:
    """Every notice, and (entry id, problem) of each malformed one."""
    good, bad = [], []
    for entry_id, fields in client.xrange(keys.repacks):
        try:
            good.append(decode(entry_id, fields))
        except EventError as exc:
            bad.append((exc.entry_id, str(exc)))
    return good, bad
