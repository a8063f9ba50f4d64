"""A coordination stream's head, moved out of Redis once no live reader needs it: without it a stream
grows by an entry per group, per version or per report for the whole run.

Each stream has one owner that trims it, by its rule (a pure function giving the MINID below which no live reader
needs an entry): ``prompts`` and ``prompts:val`` (the driver) and ``samples`` (the trainer) below their consumer
group's oldest pending entry and its last delivered one (``trim_point``); ``samples:val`` (the driver) below its
validator's cursor; ``metrics`` (the driver) and ``versions`` (the driver, keeping the newest few) by time alone
(``window_point``, ``versions.trim_point``); and never an entry written in the last ``KEEP_S`` seconds (what
``streamrl status`` reads by time). They are appended to ``<run_dir>/<run>/streams/<name>.jsonl`` (fsynced;
``NAMES``) and only then trimmed from Redis (``XTRIM MINID``, ``~`` for the large ones). Readers that need a run's
whole history (``streamrl check``, the archiver's group -> episodes map after a restart, the plots) read the file,
then Redis after the file's last id: a crash between the append and the trim leaves entries in both, read once.
One line per entry, ``{"id": ..., "fields": {name: value}}``, values as latin-1 text (bytes given back exactly); a
torn last line (a crash mid-append) is ignored and cut off before the next append (shared/protocol/archive/jsonl.py). A
reader that follows a stream from a cursor (``read_after``) indexes the file once (every 64th line's id and offset,
then only what is appended) and reads each entry's line about once, however many batches it takes."""

from __future__ import annotations

import bisect
import json
import os
import time
from array import array
from pathlib import Path
from typing import Callable

from shared.protocol.archive import jsonl

# entries written in the last 10 s stay (streamrl status counts samples/s over them by entry id); keeping them
# longer only adds a share to Redis's level that follows the rate (a minute held ~3 MB at 10 versions/s)
KEEP_S = 10
NAMES = {
    "prompts": "prompts",
    "samples": "samples",
    "prompts:val": "prompts_val",
    "samples:val": "samples_val",
    # a run's stream (its key after the run's prefix) -> its file
    "metrics": "metrics",
    "versions": "versions",
}
# a trim at most this often, or every keep_s / 4 when shorter (each: XINFO, XPENDING, XRANGE, XTRIM)
EVERY_S = 5.0


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def trim_point(last_delivered: str, first_pending: str | None, now_ms: int, keep_s: float = KEEP_S) -> str | None:
    """The MINID below which the consumer group needs nothing (pure): entries older than its oldest pending entry
    (a worker may still claim it, a trainer still train it), older than its last delivered one (the next
    reader starts after it; it stays, so the group's lag is still known), and written over ``keep_s`` ago.
    None: nothing delivered yet. A reader's cursor is a ``last_delivered`` with nothing pending."""
    if last_delivered in ("", "0-0"):
        return None
    keep = [last_delivered, window_point(now_ms, keep_s)]
    if first_pending:
        keep.append(first_pending)
    return min(keep, key=id_key)


def window_point(now_ms: int, keep_s: float = KEEP_S) -> str:
    """The MINID of a stream no reader follows from a cursor that could fall behind (pure): what is older than
    ``keep_s`` seconds."""
    return f"{max(0, now_ms - int(keep_s * 1000))}-0"


def path_of(run_path: Path | str, name: str) -> Path:
    return Path(run_path) / "streams" / f"{name}.jsonl"


def _text(v) -> str:
    return v.decode("latin-1") if isinstance(v, bytes) else str(v)


def encode(entry_id, fields: dict) -> dict:
    return {"id": _text(entry_id), "fields": {_text(k): _text(v) for k, v in fields.items()}}


def _entry(r: dict) -> tuple[bytes, dict]:
    return r["id"].encode(), {k.encode("latin-1"): v.encode("latin-1") for k, v in r["fields"].items()}


def read_head(path: Path) -> list[tuple[bytes, dict]]:
    """The file's entries as XRANGE gives them: [(id bytes, {field bytes: value bytes})]."""
    return [_entry(r) for r in jsonl.read(path, "stream head")]


def read_tail(path: Path, nbytes: int = 1 << 20) -> list[tuple[bytes, dict]]:
    """The file's entries in its last ``nbytes`` (the newest ones; the first line there, cut, skipped)."""
    return [_entry(r) for r in jsonl.tail(path, nbytes, "stream head")]


def last_id(path: Path) -> str:
    """The newest id in the file ("0-0": none), from its tail."""
    if not path.exists():
        return "0-0"
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - 65536))
        # complete lines only (a torn last one has no newline)
        lines = fh.read().split(b"\n")[:-1]
    for line in reversed(lines):
        try:
            return json.loads(line)["id"]
        except (ValueError, KeyError):
            # the tail's first line, cut
            continue
    head = jsonl.read(path, "stream head") if size > 65536 else []
    return head[-1]["id"] if head else "0-0"


def _packed(key: tuple[int, int]) -> int:
    """An entry id as one int, in the same order (a sequence number below 2**64)."""
    return key[0] << 64 | key[1]


class HeadIndex:
    """Where every ``STRIDE``-th complete line of a head file starts, and its id: built as the file grows, each byte
    parsed once (``bytes_read`` counts what was read, for the test). A file cut shorter or replaced is indexed
    again. Sparse, so a reader that follows a stream for days holds about 1 B per entry (one id and one offset per
    STRIDE lines), and a read parses at most 2 x STRIDE lines it does not return."""

    STRIDE = 64

    def __init__(self, path: Path):
        self.path = Path(path)
        self._reset(None)
        self.bytes_read = 0

    def _reset(self, inode) -> None:
        self.inode, self.end, self.lines, self.last = inode, 0, 0, 0
        # of lines 0, STRIDE, 2 x STRIDE, ...
        self.ids, self.offsets = [], array("q")
        # (the id of the last entry ``after`` gave, the offset of the line after it)
        self._resume = (-1, 0)

    def refresh(self) -> "HeadIndex":
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._reset(None)
            return self
        if st.st_ino != self.inode or st.st_size < self.end:
            self._reset(st.st_ino)
        if st.st_size > self.end:
            with open(self.path, "rb") as fh:
                fh.seek(self.end)
                data = fh.read(st.st_size - self.end)
            self.bytes_read += len(data)
            pos = 0
            # complete lines only: a torn last one waits for its repair
            while (nl := data.find(b"\n", pos)) >= 0:
                if data[pos:nl].strip():
                    try:
                        self.last = _packed(id_key(json.loads(data[pos:nl])["id"]))
                    except (ValueError, KeyError) as exc:
                        raise ValueError(
                            f"stream head {self.path}: the line at byte {self.end + pos} is not an entry ({exc})"
                        ) from None
                    if self.lines % self.STRIDE == 0:
                        self.ids.append(self.last)
                        self.offsets.append(self.end + pos)
                    self.lines += 1
                pos = nl + 1
            self.end += pos
        return self

    def newest(self) -> int:
        return self.last

    def after(self, cursor: str, count: int) -> list[tuple[bytes, dict]]:
        """Up to ``count`` entries after ``cursor``: read from the indexed line at or before it, through enough
        whole strides to hold ``count`` more."""
        key = _packed(id_key(cursor))
        if count <= 0 or key >= self.last:
            return []
        # a follower asking for what comes after its last batch: read on from there
        if self._resume[0] == key:
            pos = self._resume[1]
        else:
            pos = self.offsets[max(bisect.bisect_right(self.ids, key) - 1, 0)]
        out = []
        with open(self.path, "rb") as fh:
            fh.seek(pos)
            while len(out) < count and pos < self.end:
                # enough whole lines for what is still wanted (STRIDE lines at a time past the first guess)
                block = bisect.bisect_right(self.offsets, pos) - 1 + (count - len(out)) // self.STRIDE + 1
                data = fh.read((self.offsets[block] if block < len(self.offsets) else self.end) - pos)
                self.bytes_read += len(data)
                start = 0
                while len(out) < count and (nl := data.find(b"\n", start)) >= 0:
                    if data[start:nl].strip():
                        record = json.loads(data[start:nl])
                        if (got := _packed(id_key(record["id"]))) > key:
                            out.append(_entry(record))
                            self._resume = (got, pos + nl + 1)
                    start = nl + 1
                pos += len(data)
        return out


# a reader process's head files, indexed once each
_INDEXES: dict[str, HeadIndex] = {}


def index_of(path: Path) -> HeadIndex:
    return _INDEXES.setdefault(str(path), HeadIndex(path)).refresh()


def read_after(client, key: str, path: Path | None, cursor: str, count: int = 1000) -> list[tuple[bytes, dict]]:
    """Up to ``count`` entries after ``cursor``: from the file while the cursor is older than its newest entry (a
    reader that starts over, or fell behind the trim), then from Redis."""
    if path is not None:
        index = index_of(path)
        if _packed(id_key(cursor)) < index.newest():
            return index.after(cursor, count)
    return [e for _, es in client.xread({key: cursor}, count=count) or [] for e in es]


def read_all(client, key: str, path: Path) -> list[tuple[bytes, dict]]:
    """The stream's whole history: the file's entries, then Redis's after the file's last id."""
    head = read_head(path)
    if not head:
        return client.xrange(key)
    return head + client.xrange(key, min=f"({head[-1][0].decode()}")


def for_run(client, key: str, group: str | None, cfg, name: str | None = None, **kw) -> "Trimmer":
    """The trimmer of a run's stream ``key`` (its file ``name``, by default the key's last part: ``prompts``,
    ``samples``); ``kw``: Trimmer's ``point`` and ``store``."""
    return Trimmer(
        client,
        key,
        group,
        path_of(cfg.run_path, name or key.rsplit(":", 1)[-1]),
        keep_s=cfg.stream_keep_s,
        every_s=min(EVERY_S, max(cfg.stream_keep_s / 4, 0.5)),
        **kw,
    )


class Trimmer:
    """Moves the head of ``key`` to ``path``; ``maybe_trim`` at most every EVERY_S. Its rule: below what consumer
    group ``group`` needs (``trim_point``), or ``point(now_ms)`` when given (no group: ``window_point``). ``store``:
    whether an entry's fields go to the file (False: trimmed, the record kept elsewhere; default all)."""

    def __init__(
        self,
        client,
        key: str,
        group: str | None,
        path: Path,
        every_s: float = EVERY_S,
        keep_s: float = KEEP_S,
        point: Callable[[int], str | None] | None = None,
        store: Callable[[dict], bool] | None = None,
    ):
        self.client, self.key, self.group, self.path = client, key, group, Path(path)
        self.every_s, self.keep_s, self.point, self.store = every_s, keep_s, point, store
        self._last_run = 0.0
        # the newest id moved (from the file's tail at first, then kept)
        self._last_id: str | None = None
        self.moved = 0
        # XTRIM MINID ~: whole nodes, cheap; readers dedupe what stays in both
        self.approximate = True

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

    def minid(self, now_ms: int) -> str | None:
        if self.point is not None:
            return self.point(now_ms)
        if self.group is None:
            return window_point(now_ms, self.keep_s)
        last_delivered, first_pending = self._group()
        return trim_point(last_delivered, first_pending, now_ms, self.keep_s)

    def trim(self) -> int:
        """Append the entries below the trim point to the file (fsynced), then trim them from Redis; the count."""
        minid = self.minid(int(time.time() * 1000))
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
            kept = [(i, f) for i, f in entries if self.store is None or self.store(f)]
            if kept:
                with open(self.path, "a") as fh:
                    fh.write("".join(json.dumps(encode(i, f)) + "\n" for i, f in kept))
                    fh.flush()
                    os.fsync(fh.fileno())
            self._last_id = _text(entries[-1][0])
            start, moved = f"({self._last_id}", moved + len(kept)
        if self._last_id != "0-0":
            self.client.xtrim(self.key, minid=minid, approximate=self.approximate)
        self.moved += moved
        return moved
