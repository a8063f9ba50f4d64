"""The ``samples`` stream (and ``samples:val`` for validation rounds): one entry per finished prompt group,
written by the rollout worker that finished it, read by the trainer (consumer group ``trainer``), the driver
(validation) and the checker. Every field is plain text:

    group_id  the prompt group's id
    episodes  its episode ids, comma-separated (each is a stream ``ep:<id>``: the sample's content)
    worker    id of the worker that published it
    n         number of episodes

Publishing is idempotent and atomic with the prompt's acknowledgement (one script): the XACK of the group's
prompts entry guards the XADD. Exactly one XACK of a pending entry returns 1, so a group published twice (a
takeover racing a slow worker, a retried command, a zombie waking up days later) has one entry, and no marker key
is left behind per group (the ``sampled:<group>`` markers it replaces grew with the run). A prompts
entry leaves the consumer group's pending list only by that XACK (or a dead letter: then it is never published).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shared.protocol.episode.errors import EventError
from shared.protocol.keys import ROLLOUT_GROUP, Keys
from shared.protocol.streams import codec, once, stream_head
from shared.protocol.streams.routing import node_of

_PUBLISH = """
local acked = redis.call('XACK', KEYS[2], ARGV[5], ARGV[6])
if acked == 1 then
  redis.call('XADD', KEYS[1], '*', 'group_id', ARGV[1], 'episodes', ARGV[2], 'worker', ARGV[3], 'n', ARGV[4])
end
return acked
"""


@dataclass
class Sample:
    group_id: str
    episodes: list[str] = field(default_factory=list)
    worker: str = ""
    n: int = 0
    entry_id: str = ""


def encode(s: Sample) -> dict[str, str]:
    return {
        "group_id": s.group_id,
        "episodes": ",".join(s.episodes),
        "worker": s.worker,
        "n": str(s.n or len(s.episodes)),
    }


def decode(entry_id, fields: dict) -> Sample:
    """A samples entry; EventError naming the entry and field when malformed."""
    entry_id = codec.text(entry_id)
    f = {codec.text(k): codec.text(v) for k, v in fields.items()}
    if not f.get("group_id"):
        raise EventError(entry_id, "group_id", "samples entry needs a group id")
    if not f.get("episodes"):
        raise EventError(entry_id, "episodes", "samples entry needs its comma-separated episode ids")
    episodes = f["episodes"].split(",")
    try:
        n = int(f.get("n", len(episodes)))
    except ValueError:
        raise EventError(entry_id, "n", f"expected an integer, got {f.get('n')!r}") from None
    return Sample(f["group_id"], episodes, f.get("worker", ""), n, entry_id)


def decode_all(entries) -> tuple[list[Sample], list[tuple[str, str]]]:
    """(well-formed samples, [(entry id, error)] for the others), in stream order."""
    good, bad = [], []
    for entry_id, fields in entries:
        try:
            good.append(decode(entry_id, fields))
        except EventError as exc:
            bad.append((codec.text(entry_id), str(exc)))
    return good, bad


class Publisher:
    """Publishes finished groups: the samples entry (once per group) and the prompts entry's ack, atomically."""

    def __init__(self, client, keys: Keys):
        self.keys = keys
        self._script = client.register_script(_PUBLISH)

    def publish(self, sample: Sample, samples_key: str, prompts_key: str, prompts_entry: str) -> bool:
        """True when this call wrote the entry; False when the prompts entry was no longer pending (published
        already: a retry, a takeover's race, a zombie), a no-op logged at debug."""
        if self._script(**self._call(sample, samples_key, prompts_key, prompts_entry)):
            return True
        once.skipped("samples", group_id=sample.group_id, prompts_entry=prompts_entry)
        return False

    def add(self, pipe, sample: Sample, samples_key: str, prompts_key: str, prompts_entry: str) -> None:
        """``publish`` as one command of the caller's pipeline (no SCRIPT EXISTS round trip): its result is
        ``NoScriptError`` when the server does not have the script yet (``publish`` loads it)."""
        call = self._call(sample, samples_key, prompts_key, prompts_entry)
        pipe.execute_command(
            "EVALSHA",
            self._script.sha,
            len(call["keys"]),
            *call["keys"],
            *call["args"],
            **node_of(self._script.registered_client, call["keys"][0]),
        )

    def _call(self, sample: Sample, samples_key: str, prompts_key: str, prompts_entry: str) -> dict:
        return {
            "keys": [samples_key, prompts_key],
            "args": [
                sample.group_id,
                ",".join(sample.episodes),
                sample.worker,
                sample.n or len(sample.episodes),
                ROLLOUT_GROUP,
                prompts_entry,
            ],
        }


def read_all(client, stream: str) -> tuple[list[Sample], list[tuple[str, str]]]:
    """Every entry of ``stream`` (``keys.samples`` or ``keys.val_samples``): (samples, [(entry id, error)])."""
    return decode_all(client.xrange(stream))


def read_after(
    client, stream: str, cursor: str, count: int = 500, head: Path | None = None
) -> tuple[list[Sample], list[tuple[str, str]], str]:
    """Entries after ``cursor``: (samples, [(entry id, error)], the new cursor). ``head``: the file the trainer moves
    the stream's old entries to (shared/protocol/streams/stream_head.py), read first while the cursor is older."""
    entries = stream_head.read_after(client, stream, head, cursor, count)
    good, bad = decode_all(entries)
    return good, bad, (codec.text(entries[-1][0]) if entries else cursor)


def read_since(client, stream: str, since_ms: int) -> list[Sample]:
    """Well-formed entries written at or after unix time ``since_ms`` (milliseconds; from their entry ids)."""
    return decode_all(client.xrange(stream, min=f"{since_ms}-0"))[0]


def entry_ms(entry_id: str) -> int:
    """The unix time in milliseconds at which an entry was written, from its id."""
    return int(entry_id.split("-")[0])
