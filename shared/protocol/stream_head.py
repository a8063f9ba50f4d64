"""A coordination stream's head, moved out of Redis once no live reader needs it (issue 33): without it the
``prompts`` and ``samples`` streams grow by an entry per group for the whole run.

The owner of a stream's consumer group trims it (the driver ``prompts``, the trainer ``samples``): entries older
than both the group's oldest pending entry and its last delivered one, and older than ``KEEP_S`` seconds (what
``streamrl status`` reads by time), are appended to ``<run_dir>/<run>/streams/<name>.jsonl`` (fsynced) and only
then trimmed from Redis (``XTRIM MINID ~``). Readers that need a run's whole history (``streamrl check``, the
archiver's group -> episodes map after a restart) read the file, then Redis after the file's last id: a crash
between the append and the trim leaves entries in both, read once. One line per entry,
``{"id": ..., "fields": {name: value}}``, values as latin-1 text (bytes given back exactly); a torn last line
(a crash mid-append) is ignored and cut off before the next append (shared/protocol/jsonl.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from shared.protocol import jsonl

KEEP_S = 60  # entries written in the last minute stay (streamrl status counts samples/s over 30 s by entry id)
EVERY_S = 5.0  # a trim at most this often, or every keep_s / 4 when shorter (each: XINFO, XPENDING, XRANGE, XTRIM)


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def trim_point(last_delivered: str, first_pending: str | None, now_ms: int, keep_s: float = KEEP_S) -> str | None:
    """The MINID below which the consumer group needs nothing (pure): entries older than its oldest pending entry
    (a worker may still claim it, a trainer still train it), older than its last delivered one (the next
    reader starts after it; it stays, so the group's lag is still known), and written over ``keep_s`` ago.
    None: nothing delivered yet."""
    if last_delivered in ("", "0-0"):
        return None
    keep = [last_delivered, f"{now_ms - int(keep_s * 1000)}-0"]
    if first_pending:
        keep.append(first_pending)
    return min(keep, key=id_key)


def path_of(run_path: Path | str, name: str) -> Path:
    return Path(run_path) / "streams" / f"{name}.jsonl"


def _text(v) -> str:
    return v.decode("latin-1") if isinstance(v, bytes) else str(v)


def encode(entry_id, fields: dict) -> dict:
    return {"id": _text(entry_id), "fields": {_text(k): _text(v) for k, v in fields.items()}}


def read_head(path: Path) -> list[tuple[bytes, dict]]:
    """The file's entries as XRANGE gives them: [(id bytes, {field bytes: value bytes})]."""
    return [(r["id"].encode(), {k.encode("latin-1"): v.encode("latin-1") for k, v in r["fields"].items()})
            for r in jsonl.read(path, "stream head")]


def last_id(path: Path) -> str:
    """The newest id in the file ("0-0": none), from its tail."""
    if not path.exists():
        return "0-0"
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - 65536))
        lines = fh.read().split(b"\n")[:-1]  # complete lines only (a torn last one has no newline)
    for line in reversed(lines):
        try:
            return json.loads(line)["id"]
        except (ValueError, KeyError):
            continue  # the tail's first line, cut
    head = jsonl.read(path, "stream head") if size > 65536 else []
    return head[-1]["id"] if head else "0-0"


def read_after(client, key: str, path: Path | None, cursor: str, count: int = 1000) -> list[tuple[bytes, dict]]:
    """Up to ``count`` entries after ``cursor``: from the file while the cursor is older than its newest entry (a
    reader that starts over, or fell behind the trim), then from Redis."""
    if path is not None and id_key(cursor) < id_key(last_id(path)):
        return [e for e in read_head(path) if id_key(e[0].decode()) > id_key(cursor)][:count]
    return [e for _, es in client.xread({key: cursor}, count=count) or [] for e in es]


def read_all(client, key: str, path: Path) -> list[tuple[bytes, dict]]:
    """The stream's whole history: the file's entries, then Redis's after the file's last id."""
    head = read_head(path)
    if not head:
        return client.xrange(key)
    return head + client.xrange(key, min=f"({head[-1][0].decode()}")


def for_run(client, key: str, group: str, cfg) -> "Trimmer":
    """The trimmer of a run's stream ``key`` (its file named after the key's last part: ``prompts``, ``samples``)."""
    return Trimmer(client, key, group, path_of(cfg.run_path, key.rsplit(":", 1)[-1]), keep_s=cfg.stream_keep_s,
                   every_s=min(EVERY_S, max(cfg.stream_keep_s / 4, 0.5)))


class Trimmer:
    """Moves the head of ``key`` (consumer group ``group``) to ``path``; ``maybe_trim`` at most every EVERY_S."""

    def __init__(self, client, key: str, group: str, path: Path, every_s: float = EVERY_S, keep_s: float = KEEP_S):
        self.client, self.key, self.group, self.path = client, key, group, Path(path)
        self.every_s, self.keep_s = every_s, keep_s
        self._last_run = 0.0
        self._last_id: str | None = None  # the file's newest id (read once, then kept)
        self.moved = 0
        self.approximate = True  # XTRIM MINID ~: whole nodes, cheap; readers dedupe what stays in both

    def maybe_trim(self) -> int:
        if time.monotonic() - self._last_run < self.every_s:
            return 0
        self._last_run = time.monotonic()
        return self.trim()

    def _group(self) -> tuple[str, str | None]:
        info = {_text(g["name"]): g for g in self.client.xinfo_groups(self.key)} if self.client.exists(self.key) else {}
        if self.group not in info:
            return "0-0", None
        summary = self.client.xpending(self.key, self.group)
        first = summary.get("min") if summary.get("pending") else None
        return _text(info[self.group]["last-delivered-id"]), _text(first) if first else None

    def trim(self) -> int:
        """Append the entries below the trim point to the file (fsynced), then trim them from Redis; the count."""
        last_delivered, first_pending = self._group()
        minid = trim_point(last_delivered, first_pending, int(time.time() * 1000), self.keep_s)
        if minid is None:
            return 0
        if self._last_id is None:
            jsonl.repair(self.path)
            self._last_id = last_id(self.path)
        start, moved = f"({self._last_id}" if self._last_id != "0-0" else "-", 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            entries = self.client.xrange(self.key, min=start, max=f"({minid}", count=1000)
            if not entries:
                break
            with open(self.path, "a") as fh:
                fh.write("".join(json.dumps(encode(i, f)) + "\n" for i, f in entries))
                fh.flush()
                os.fsync(fh.fileno())
            self._last_id = _text(entries[-1][0])
            start, moved = f"({self._last_id}", moved + len(entries)
        if self._last_id != "0-0":
            self.client.xtrim(self.key, minid=minid, approximate=self.approximate)
        self.moved += moved
        return moved
