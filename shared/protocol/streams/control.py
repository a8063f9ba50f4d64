"""The ``control`` stream: commands from the syncer to rollout workers, and
their acknowledgements. Every field is plain text (readable in redis-cli).

Command entries: ``type=cmd``, ``cmd`` (fetch | pause | load | resume), ``sync`` (id
of the sync round), ``version`` (fetch, load: the version), ``path`` and
``sha256`` (fetch, load: the published weights file and its checksum), ``url``
(fetch, load; optional: where to download the file when ``path`` is not
readable on the worker's host), ``targets`` (optional, a JSON list of worker ids: only they obey the command; an
entry without it is for every worker), ``sources`` (fetch, optional: a JSON object worker id -> the URL of a relay,
another worker holding a verified copy, to download from instead of ``url``; ``url`` stays the fallback).

A sync round is fetch, pause, load, resume (``sync_mode`` rolling: the fetch, then pause, load, resume once per wave
of at most ``max_loading`` workers, each command naming its wave in ``targets``; with relays the fetch goes out once
per level of the relay tree, each naming its level). ``fetch``: each worker gets the version's file into a folder of its
own (or checks the published one it can read) while it goes on generating, and acks once it holds a verified copy;
``load`` then loads that local copy inside the pause (a load with no fetch before it fetches then).

Ack entries: ``type=ack``, ``cmd``, ``sync``, ``worker``, ``ok`` (1 or 0),
``version`` (the worker's version after the command: fetch does not change it), ``error`` (when ok=0).

Written once, read tolerantly: the sync id is fixed for a whole sync round (made once, before the first
command, so a retried XADD carries the same one); ``send_command`` and ``send_ack`` set the field
``<cmd>:<worker>`` of the round's one hash ``control:sent:<sync>`` with HSETNX in the same script as the XADD, so a
retried write adds nothing (a no-op, logged at debug; the hash lives ``once.RETRY_MARKER_TTL_S`` after the round's
last write, longer than any retry; a small hash is a listpack: a field costs a few bytes, a key ~100); a duplicate
that still gets through (an older writer, a hand-written entry, a retry after that) is obeyed once by a worker
that asks ``Seen.first`` and counted once by the syncer (acks go in a set).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shared.protocol.episode.errors import EventError
from shared.protocol.keys import Keys
from shared.protocol.streams import codec, once

_SEND = """
if redis.call('HSETNX', KEYS[1], ARGV[1], '1') == 1 then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
end
return false
"""
# the control stream is capped (approximately)
MAXLEN = 10_000

COMMANDS = ("fetch", "pause", "load", "resume")
# commands that name a version's file
WITH_WEIGHTS = ("fetch", "load")


@dataclass
class Command:
    cmd: str
    sync: str
    version: int = -1
    path: str = ""
    sha256: str = ""
    entry_id: str = ""
    url: str = ""
    # the workers that obey it; () = every worker
    targets: tuple[str, ...] = ()
    # fetch: worker -> relay URL to try before ``url``
    sources: dict[str, str] = field(default_factory=dict)

    def for_worker(self, worker: str) -> bool:
        """Whether ``worker`` obeys this command (a worker not named ignores it, and does not remember it)."""
        return not self.targets or worker in self.targets


def encode_command(c: Command) -> dict:
    fields = {
        "type": "cmd",
        "cmd": c.cmd,
        "sync": c.sync,
        "version": str(c.version),
        "path": c.path,
        "sha256": c.sha256,
    }
    if c.url:
        fields["url"] = c.url
    if c.targets:
        fields["targets"] = json.dumps(sorted(c.targets))
    if c.sources:
        fields["sources"] = json.dumps(c.sources, sort_keys=True)
    return fields


def _json_field(entry_id: str, f: dict, name: str, kind: type, empty):
    if not f.get(name):
        return empty
    try:
        value = json.loads(f[name])
    except ValueError:
        value = None
    ok = isinstance(value, kind) and all(isinstance(x, str) for x in (value.values() if kind is dict else value))
    if not ok:
        what = "a JSON list of worker ids" if kind is list else "a JSON object of worker id -> URL"
        raise EventError(entry_id, name, f"expected {what}, got {f[name][:80]!r}")
    return value


@dataclass(frozen=True)
class Ack:
    cmd: str
    sync: str
    worker: str
    ok: bool
    version: int = -1
    error: str = ""


def decode_ack(f: dict) -> Ack:
    """An ack entry's fields (strings) as an Ack."""
    try:
        version = int(f.get("version", "-1"))
    except ValueError:
        version = -1
    return Ack(
        f.get("cmd", ""), f.get("sync", ""), f.get("worker", ""), f.get("ok") != "0", version, f.get("error", "")
    )


def decode_entry(entry_id, fields: dict) -> Command | dict:
    """A command, or an ack as a dict of strings (``decode_ack`` makes it an Ack). EventError when malformed."""
    entry_id = codec.text(entry_id)
    f = {codec.text(k): codec.text(v) for k, v in fields.items()}
    kind = f.get("type")
    if kind == "ack":
        return f
    if kind != "cmd":
        raise EventError(entry_id, "type", f"expected 'cmd' or 'ack', got {kind!r}")
    if f.get("cmd") not in COMMANDS:
        raise EventError(entry_id, "cmd", f"expected one of {', '.join(COMMANDS)}, got {f.get('cmd')!r}")
    if not f.get("sync"):
        raise EventError(entry_id, "sync", "missing sync round id")
    try:
        version = int(f.get("version", "-1"))
    except ValueError:
        raise EventError(entry_id, "version", f"expected an integer, got {f.get('version')!r}") from None
    if f["cmd"] in WITH_WEIGHTS and (version < 0 or not f.get("path")):
        raise EventError(entry_id, "path", f"a {f['cmd']} command needs version >= 0 and a weights path")
    targets = tuple(_json_field(entry_id, f, "targets", list, []))
    sources = _json_field(entry_id, f, "sources", dict, {})
    return Command(
        f["cmd"],
        f["sync"],
        version,
        f.get("path", ""),
        f.get("sha256", ""),
        entry_id,
        f.get("url", ""),
        targets,
        sources,
    )


def ack(cmd: Command, worker: str, ok: bool, version: int, error: str = "") -> dict:
    return {
        "type": "ack",
        "cmd": cmd.cmd,
        "sync": cmd.sync,
        "worker": worker,
        "ok": "1" if ok else "0",
        "version": str(version),
        "error": error,
    }


def sent_field(cmd: str, worker: str = "") -> str:
    """The field of the round's ``control:sent:<sync>`` hash that marks a command (or, with ``worker``, its ack)."""
    return f"{cmd}:{worker}"


def _send(client, keys: Keys, marker: str, fields: dict, write: str) -> str | None:
    flat = [x for kv in fields.items() for x in kv]
    entry_id = client.eval(
        _SEND, 2, keys.control_sent(fields["sync"]), keys.control, marker, once.RETRY_MARKER_TTL_S, MAXLEN, *flat
    )
    if entry_id is None:
        once.skipped(write, sync=fields["sync"], cmd=fields["cmd"], worker=fields.get("worker", ""))
        return None
    return codec.text(entry_id)


def send_command(client, keys: Keys, c: Command, part: str = "") -> str | None:
    """Write ``c`` once per (sync, cmd, part): its entry id, None when it was already written (a retry). ``part``
    names one of several commands of a kind in a round (a wave, a level of the fetch tree)."""
    return _send(client, keys, sent_field(f"{c.cmd}#{part}" if part else c.cmd), encode_command(c), "control command")


def send_ack(client, keys: Keys, cmd: Command, worker: str, ok: bool, version: int, error: str = "") -> str | None:
    """Write ``worker``'s ack of ``cmd`` once: its entry id, None when it was already written (a retry)."""
    return _send(client, keys, sent_field(cmd.cmd, worker), ack(cmd, worker, ok, version, error), "control ack")


def read_after(client, keys: Keys, cursor: str, count: int = 100, block_ms: int | None = None) -> list[tuple]:
    """[(entry id, Command | ack dict | EventError)] after ``cursor``: a malformed entry comes back as its error."""
    out = []
    for _, entries in client.xread({keys.control: cursor}, count=count, block=block_ms) or []:
        for entry_id, fields in entries:
            try:
                out.append((codec.text(entry_id), decode_entry(entry_id, fields)))
            except EventError as exc:
                out.append((codec.text(entry_id), exc))
    return out


class Seen:
    """A worker's memory of the commands it obeyed: ``first(cmd)`` is False for a (sync, cmd) seen before,
    so a command that got into the stream twice is obeyed (and acked) once."""

    def __init__(self, keep: int = 64):
        self.keep, self._seen = keep, {}

    def first(self, cmd: Command) -> bool:
        key = (cmd.sync, cmd.cmd)
        if key in self._seen:
            once.skipped("control command (read twice)", sync=cmd.sync, cmd=cmd.cmd, entry=cmd.entry_id)
            return False
        self._seen[key] = True
        while len(self._seen) > self.keep:
            self._seen.pop(next(iter(self._seen)))
        return True


def last_id(client, keys: Keys) -> str:
    """The id of the newest control entry ("0-0" when none): read after it to see only what comes next."""
    last = client.xrevrange(keys.control, count=1)
    return codec.text(last[0][0]) if last else "0-0"
