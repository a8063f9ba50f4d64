"""The cold tier of the episode log: append-only Parquet segment files under ``<run_dir>/<run>/episodes/``.

One row per episode. ``entry_ids`` and ``entries`` hold its stream exactly as XRANGE returned it (entry ids,
then each entry's fields as alternating name/value bytes), so an episode read from a segment folds and replays
byte-identical to the same episode read from Redis. The other columns are for analysis (pandas, DuckDB,
``datasets.load_dataset("parquet", data_files=".../episodes/seg-*.parquet")``): episode and group ids, the
worker that ended it, reward, status, finish reason, number of generated tokens, the newest policy version that
produced one of its tokens. Compression: zstd.

Format 2 (``FORMAT``, in each file's metadata under ``streamrl.segment_format``) stores the token payloads
columnar (shared/protocol/segment_columns.py: ``tok_counts``, ``tok_ids``, ``tok_logprobs``); files of format 1
(no such columns) still read, as they were written.

A segment is durable before anything may rely on it: written to ``.seg-N.parquet.tmp``, fsynced, renamed to
``seg-N.parquet``, the folder fsynced, then a line appended (and fsynced) to ``_manifest.jsonl``. Only segments
the manifest lists exist for readers; a file the manifest does not list (a crash before the line) is an orphan
that ``remove_orphans`` deletes. Each episode id is in at most one listed segment (the mover skips episodes
already listed).
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from shared.protocol import jsonl, segment_columns
from shared.protocol.events import EventError
from shared.protocol.fold import fold

FOLDER = "episodes"
MANIFEST = "_manifest.jsonl"  # "_": pyarrow, pandas and datasets skip it when reading the folder

SCHEMA = pa.schema([
    ("episode_id", pa.string()),
    ("group_id", pa.string()),
    ("worker", pa.string()),
    ("status", pa.string()),
    ("finish_reason", pa.string()),
    ("reward", pa.float64()),
    ("num_generated", pa.int32()),
    ("version", pa.int32()),
    ("entry_ids", pa.list_(pa.binary())),
    ("entries", pa.list_(pa.list_(pa.binary()))),
    ("tok_counts", pa.list_(pa.int32())),
    ("tok_ids", pa.binary()),
    ("tok_logprobs", pa.binary()),
], metadata={b"streamrl.segment_format": b"2"})
FORMAT = 2
LEVEL = 15  # zstd level: 15 gives the token columns ~5 % over 9 for ~1 us a token (bench/tiers.py)
RAW = ["episode_id", "entry_ids", "entries"]  # the columns an episode's entries come back from
TOKEN_COLUMNS = ["tok_counts", "tok_ids", "tok_logprobs"]  # format 2 only


def _b(v) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def to_row(episode_id: str, entries: list[tuple]) -> dict:
    """An episode's XRANGE entries -> one row (raw entries kept as they are; analysis columns from its fold)."""
    flat, counts, ids, lps = segment_columns.pack([[_b(x) for kv in fields.items() for x in kv]
                                                    for _, fields in entries])
    row = {"episode_id": episode_id, "group_id": "", "worker": "", "status": "", "finish_reason": None,
           "reward": None, "num_generated": 0, "version": -1,
           "entry_ids": [_b(i) for i, _ in entries], "entries": flat,
           "tok_counts": counts, "tok_ids": ids, "tok_logprobs": lps}
    try:
        ep = fold(entries)
    except EventError:  # kept as it is all the same: the raw entries are the record
        return row
    row.update(group_id=ep.group_id, worker=ep.last_worker, status=ep.status, finish_reason=ep.finish_reason,
               reward=ep.reward, num_generated=ep.num_generated, version=max(ep.versions, default=-1))
    return row


def from_row(row: dict) -> list[tuple]:
    """A row (either format) -> the episode's entries as XRANGE returns them (bytes ids, {bytes: bytes} fields)."""
    entries = row["entries"]
    if row.get("tok_counts") is not None:
        entries = segment_columns.unpack(entries, row["tok_counts"], row["tok_ids"], row["tok_logprobs"])
    return [(i, dict(zip(flat[::2], flat[1::2]))) for i, flat in zip(row["entry_ids"], entries)]


def file_format(path: Path) -> int:
    """A segment file's format: 2 and later say so in the file's metadata; a file without it is format 1."""
    metadata = pq.read_schema(path).metadata or {}
    return int(metadata.get(b"streamrl.segment_format", b"1"))


def raw_columns(path: Path) -> list[str]:
    """The columns to read an episode's entries from this file (format 1 files have no token columns)."""
    names = pq.read_schema(path).names
    return RAW + [c for c in TOKEN_COLUMNS if c in names]


def folder_of(run_path: Path | str) -> Path:
    return Path(run_path) / FOLDER


def write_file(folder: Path, name: str, rows: list[dict]) -> int:
    """Write the rows to ``folder/name`` durably (tmp, fsync, rename, fsync folder); returns its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.tmp"
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    with open(tmp, "wb") as fh:
        pq.write_table(table, fh, compression="zstd", compression_level=LEVEL)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / name)
    jsonl.fsync_dir(folder)
    return (folder / name).stat().st_size


def append_manifest(folder: Path, record: dict) -> None:
    jsonl.append(folder / MANIFEST, record)


def read_manifest(folder: Path) -> list[dict]:
    """The listed segments; a torn last line (a crash mid-append) is not a listing."""
    return jsonl.read(folder / MANIFEST, "segment manifest")


def repair_manifest(folder: Path) -> None:
    """Cut a torn last line off the manifest before the next append."""
    jsonl.repair(folder / MANIFEST)


def remove_orphans(folder: Path) -> list[str]:
    """Delete segment files the manifest does not list (a crash between the rename and the manifest line)."""
    if not folder.is_dir():
        return []
    listed = {r["segment"] for r in read_manifest(folder)}
    gone = []
    for path in folder.iterdir():
        if path.name.startswith(".seg-") or (path.name.startswith("seg-") and path.name not in listed):
            path.unlink()
            gone.append(path.name)
    return gone


def next_name(folder: Path) -> str:
    """The next segment's file name (numbered after every listed one and every file present)."""
    seen = [r["segment"] for r in read_manifest(folder)]
    if folder.is_dir():
        seen += [p.name.lstrip(".") for p in folder.iterdir() if "seg-" in p.name]
    numbers = [int(n.split("-")[1].split(".")[0]) for n in seen]
    return f"seg-{max(numbers, default=0) + 1:08d}.parquet"


class SegmentStore:
    """Reads episodes out of a run's listed segments (the index refreshes when the manifest grows)."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self._index: dict[str, str] = {}  # episode id -> segment file
        self._listed: set[str] = set()
        self._manifest_size = -1

    def refresh(self) -> None:
        path = self.folder / MANIFEST
        size = path.stat().st_size if path.exists() else 0
        if size == self._manifest_size:
            return
        for record in read_manifest(self.folder):
            name = record["segment"]
            if name in self._listed:
                continue
            ids = pq.read_table(self.folder / name, columns=["episode_id"]).column("episode_id").to_pylist()
            for episode_id in ids:
                self._index.setdefault(episode_id, name)
            self._listed.add(name)
        self._manifest_size = size

    def episode_ids(self) -> set[str]:
        self.refresh()
        return set(self._index)

    def __contains__(self, episode_id: str) -> bool:
        self.refresh()
        return episode_id in self._index

    def read_many(self, episode_ids: list[str]) -> dict[str, list[tuple]]:
        """{episode id: entries} of those of ``episode_ids`` that a listed segment holds."""
        self.refresh()
        by_segment: dict[str, list[str]] = {}
        for episode_id in episode_ids:
            if episode_id in self._index:
                by_segment.setdefault(self._index[episode_id], []).append(episode_id)
        out: dict[str, list[tuple]] = {}
        for name, wanted in by_segment.items():
            table = pq.read_table(self.folder / name, columns=raw_columns(self.folder / name),
                                  filters=[("episode_id", "in", wanted)])
            for row in table.to_pylist():
                out[row["episode_id"]] = from_row(row)
        return out

    def read(self, episode_id: str) -> list[tuple]:
        return self.read_many([episode_id]).get(episode_id, [])

    def iter_all(self):
        """(episode id, entries) of every archived episode, segment by segment."""
        self.refresh()
        for name in sorted(self._listed):
            for row in pq.read_table(self.folder / name, columns=raw_columns(self.folder / name)).to_pylist():
                if self._index.get(row["episode_id"]) == name:
                    yield row["episode_id"], from_row(row)

    def sizes(self) -> dict:
        """Segments, episodes and bytes on disk (for status and metrics)."""
        records = read_manifest(self.folder)
        return {"segments": len(records), "episodes": sum(r.get("episodes", 0) for r in records),
                "bytes": sum(r.get("bytes", 0) for r in records), "tokens": sum(r.get("tokens", 0) for r in records)}
