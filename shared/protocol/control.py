"""The ``control`` stream: commands from the syncer to rollout workers, and
their acknowledgements. Every field is plain text (readable in redis-cli).

Command entries: ``type=cmd``, ``cmd`` (pause | load | resume), ``sync`` (id
of the sync round), ``version`` (load: the version to load), ``path`` and
``sha256`` (load: the weights file and its checksum).

Ack entries: ``type=ack``, ``cmd``, ``sync``, ``worker``, ``ok`` (1 or 0),
``version`` (the worker's version after the command), ``error`` (when ok=0).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol.events import EventError

COMMANDS = ("pause", "load", "resume")


@dataclass
class Command:
    cmd: str
    sync: str
    version: int = -1
    path: str = ""
    sha256: str = ""
    entry_id: str = ""


def _s(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def encode_command(c: Command) -> dict:
    return {"type": "cmd", "cmd": c.cmd, "sync": c.sync, "version": str(c.version), "path": c.path,
            "sha256": c.sha256}


def decode_entry(entry_id, fields: dict) -> Command | dict:
    """A command, or an ack as a dict of strings. EventError when malformed."""
    entry_id = _s(entry_id)
    f = {_s(k): _s(v) for k, v in fields.items()}
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
    if f["cmd"] == "load" and (version < 0 or not f.get("path")):
        raise EventError(entry_id, "path", "a load command needs version >= 0 and a weights path")
    return Command(f["cmd"], f["sync"], version, f.get("path", ""), f.get("sha256", ""), entry_id)


def ack(cmd: Command, worker: str, ok: bool, version: int, error: str = "") -> dict:
    return {"type": "ack", "cmd": cmd.cmd, "sync": cmd.sync, "worker": worker, "ok": "1" if ok else "0",
            "version": str(version), "error": error}
