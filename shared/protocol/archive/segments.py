"""The cold tier of the episode log: append-only Parquet segment files under ``<run_dir>/<run>/episodes/``.

One row per episode. Its entries are kept so that an episode read from a segment folds and replays byte-identical
to the same episode read from Redis: format 4 (``FORMAT``, in each file's metadata under
``streamrl.segment_format``) splits them into columns (shared/protocol/archive/entries.py): header fields and
entry ids as small numbers and dictionary values, a group's shared ``started`` payload (prompt ids and all) once
per segment in the row's ``start`` column, the end entry's payload in ``end``, token ids and log-probs as
``tok_ids`` / ``tok_logprobs`` lists stored in byte planes. Files of format 1 (raw ``entry_ids`` / ``entries``),
2 (those plus byte-plane token blobs, shared/protocol/archive/columns.py) and 3 (format 4 but with those two
payloads inside ``payloads``) still read, as they were written. The other columns are for analysis (pandas,
DuckDB, ``datasets.load_dataset("parquet", data_files=".../episodes/seg-*.parquet")``): episode and group ids,
the worker that ended it, reward, status, finish reason, number of generated tokens, the newest policy version
that produced one of its tokens, its index in the group and its seed. Compression: zstd.

A segment is durable before anything may rely on it: written to ``.seg-N.parquet.tmp``, fsynced, renamed to
``seg-N.parquet``, the folder fsynced, then a line appended (and fsynced) to ``_manifest.jsonl``. Only segments
the manifest lists exist for readers; a file the manifest does not list (a crash before the line) is an orphan
that ``remove_orphans`` deletes. Each episode id is in at most one listed segment (the mover skips episodes
already listed).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shared.protocol.archive import (
    arrays as segment_arrays,
)
from shared.protocol.archive import (
    columns as segment_columns,
)
from shared.protocol.archive import (
    entries as segment_entries,
)
from shared.protocol.archive import (
    jsonl,
)
from shared.protocol.archive.index import SegmentIndex

FOLDER = "episodes"
# "_": pyarrow, pandas and datasets skip it when reading the folder
MANIFEST = "_manifest.jsonl"

ANALYSIS = [
    ("episode_id", pa.string()),
    ("group_id", pa.string()),
    ("worker", pa.string()),
    ("status", pa.string()),
    ("finish_reason", pa.string()),
    ("reward", pa.float64()),
    ("num_generated", pa.int32()),
    ("version", pa.int32()),
]
SCHEMA = pa.schema(
    ANALYSIS
    + [
        ("index", pa.int32()),
        ("seed", pa.int64()),
        ("seed_base", pa.int64()),
        ("t0", pa.int64()),
        ("ms", pa.list_(pa.int32())),
        ("sub", pa.list_(pa.int32())),
        ("kinds", pa.list_(pa.binary())),
        ("hv", pa.list_(pa.binary())),
        ("policies", pa.list_(pa.int32())),
        ("workers", pa.list_(pa.binary())),
        ("payloads", pa.list_(pa.binary())),
        # format 4: the first started payload, templated (shared/protocol/archive/entries.py)
        ("start", pa.binary()),
        # format 4: the end entry's payload
        ("end", pa.binary()),
        ("others", pa.list_(pa.list_(pa.binary()))),
        ("tok_counts", pa.list_(pa.int32())),
        ("tok_ids", pa.list_(pa.uint32())),
        # null: exactly +0.0 (a token the sampler was sure of)
        ("tok_logprobs", pa.list_(pa.float32())),
    ],
    metadata={b"streamrl.segment_format": b"4"},
)
FORMAT = 4
TERMINAL = (b"finished", b"failed")
# zstd level: on the default run's episodes 12 costs 3 us an episode to 15's 8, for 2 % more bytes
LEVEL = 12
TOKENS = ["tok_ids", "tok_logprobs"]
# stored in byte planes (Parquet's BYTE_STREAM_SPLIT)
PLANES = [f"{c}.list.element" for c in TOKENS]
DICTIONARY = [
    "group_id",
    "worker",
    "status",
    "finish_reason",
    "reward",
    "num_generated",
    "version",
    "index",
    "seed_base",
    "ms",
    "sub",
    "kinds",
    "hv",
    "policies",
    "workers",
    "payloads",
    "start",
    "end",
    "tok_counts",
]
# rising times, ids sharing a prefix
DELTAS = {"t0": "DELTA_BINARY_PACKED", "episode_id": "DELTA_BYTE_ARRAY"}
ENCODINGS = {**{c: "BYTE_STREAM_SPLIT" for c in PLANES}, **DELTAS}
ENTRY_COLUMNS = [f.name for f in SCHEMA if f.name not in dict(ANALYSIS) or f.name == "episode_id"]
# format 1 and 2: the columns an episode's entries come back from
RAW = ["episode_id", "entry_ids", "entries"]
# format 2 only
TOKEN_COLUMNS = ["tok_counts", "tok_ids", "tok_logprobs"]


def _b(v) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def flat(entries: list[tuple]) -> list[tuple[bytes, list[bytes]]]:
    """XRANGE entries as redis-py gives them, ``(id, {name: value})`` -> ``(id, [name, value, ...])`` as bytes (as
    the server sends them: ``services/archiver`` reads them so)."""
    return [(_b(i), [_b(x) for kv in fields.items() for x in kv]) for i, fields in entries]


def ended(entries: list[tuple[bytes, list[bytes]]]) -> bool:
    """Whether an episode's stream (flat entries) has ended: its last entry is a ``finished`` or ``failed``."""
    if not entries:
        return False
    fields = entries[-1][1]
    return fields[:1] == [b"type"] and fields[1] in TERMINAL


def token_bytes(table: pa.Table, name: str) -> tuple[np.ndarray, bytes]:
    """(offsets, raw little-endian values) of a token column (a null log-prob is +0.0)."""
    col = table.column(name).combine_chunks()
    values = col.values.fill_null(0) if name == "tok_logprobs" else col.values
    return col.offsets.to_numpy(), values.to_numpy(zero_copy_only=False).tobytes()


def entries_of(table: pa.Table) -> list[tuple[str, list[tuple]]]:
    """(episode id, entries as XRANGE returns them) of each row of a table read with ``raw_columns``."""
    # format 1 or 2
    if "kinds" not in table.column_names:
        return [(row["episode_id"], from_row(row)) for row in table.to_pylist()]
    (offsets, ids), (_, lps) = token_bytes(table, "tok_ids"), token_bytes(table, "tok_logprobs")
    out = []
    for k, row in enumerate(table.drop_columns(TOKENS).to_pylist()):
        a, b = 4 * offsets[k], 4 * offsets[k + 1]
        out.append((row["episode_id"], segment_entries.unpack(row["episode_id"], row, ids[a:b], lps[a:b])))
    return out


def from_row(row: dict) -> list[tuple]:
    """A row of format 1 or 2 -> the episode's entries as XRANGE returns them (bytes ids, {bytes: bytes} fields)."""
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
    # format 3 (no start / end) or 4
    if "kinds" in names:
        return [c for c in ENTRY_COLUMNS if c in names]
    return RAW + [c for c in TOKEN_COLUMNS if c in names]


def encodings(table: pa.Table) -> dict[str, str]:
    """The columns' Parquet encodings for this segment: ``ENCODINGS``, but log-probs in plain bytes when zstd packs
    them smaller so (segment_columns.planes_pay_off: whole values that repeat); readers need not know which."""
    values = segment_arrays.valid_values(table.column("tok_logprobs").combine_chunks().values)
    if segment_columns.planes_pay_off(values.tobytes()):
        return ENCODINGS
    return {k: v for k, v in ENCODINGS.items() if k != PLANES[1]}


def folder_of(run_path: Path | str) -> Path:
    return Path(run_path) / FOLDER


def write_file(folder: Path, name: str, table: pa.Table) -> int:
    """Write a segment's table (shared/protocol/archive/builder.py) to ``folder/name`` durably (tmp, fsync, rename,
    fsync folder); returns its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.tmp"
    with open(tmp, "wb") as fh:
        with pq.ParquetWriter(
            fh,
            table.schema,
            compression="zstd",
            compression_level=LEVEL,
            use_dictionary=DICTIONARY,
            column_encoding=encodings(table),
            write_statistics=["episode_id"],
            # no Arrow schema copy: the Parquet types say it all
            store_schema=False,
        ) as writer:
            writer.write_table(table)
            writer.add_key_value_metadata(SCHEMA.metadata)
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
    """Reads episodes out of a run's listed segments (the index refreshes when the manifest grows; it holds a hash
    per archived episode, shared/protocol/archive/index.py, not its id)."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        # the listed segments, in listing order
        self._names: list[str] = []
        self._numbers: dict[str, int] = {}
        self._index = SegmentIndex()
        self._manifest_size = -1

    def refresh(self) -> None:
        path = self.folder / MANIFEST
        size = path.stat().st_size if path.exists() else 0
        if size == self._manifest_size:
            return
        for record in read_manifest(self.folder):
            if record["segment"] not in self._numbers:
                self.add(record["segment"], self._ids_of(record["segment"]))
        self._manifest_size = size

    def add(self, name: str, episode_ids: list[str]) -> None:
        """Index a segment listed just now by its writer (which knows its episodes: no read of the file)."""
        if name not in self._numbers:
            self._numbers[name] = len(self._names)
            self._names.append(name)
            self._index.add(self._numbers[name], episode_ids)

    def _ids_of(self, name: str) -> list[str]:
        return pq.ParquetFile(self.folder / name).read(columns=["episode_id"]).column("episode_id").to_pylist()

    def segments(self) -> list[str]:
        """The listed segments, in listing order."""
        self.refresh()
        return list(self._names)

    def ids(self, since: int = 0):
        """The episode ids of the listed segments from the ``since``-th on, in listing order (read off the files)."""
        for name in self.segments()[since:]:
            yield from self._ids_of(name)

    def may_hold(self, episode_ids: list[str]) -> list[bool]:
        """For each id, whether a listed segment may hold it: True for every archived one, and for another id only
        when its hash is an archived one's (segment_index.py)."""
        self.refresh()
        return self._index.may_hold(episode_ids).tolist()

    def read_many(self, episode_ids: list[str]) -> dict[str, list[tuple]]:
        """{episode id: entries} of those of ``episode_ids`` that a listed segment holds (the first listed that
        does)."""
        self.refresh()
        by_segment: dict[int, list[str]] = {}
        for episode_id, numbers in zip(episode_ids, self._index.candidates(episode_ids)):
            for number in numbers:
                by_segment.setdefault(number, []).append(episode_id)
        out: dict[str, list[tuple]] = {}
        for number in sorted(by_segment):
            wanted = [e for e in by_segment[number] if e not in out]
            if not wanted:
                continue
            path = self.folder / self._names[number]
            for episode_id, entries in entries_of(
                pq.read_table(path, columns=raw_columns(path), filters=[("episode_id", "in", wanted)])
            ):
                out.setdefault(episode_id, entries)
        return out

    def read(self, episode_id: str) -> list[tuple]:
        return self.read_many([episode_id]).get(episode_id, [])

    def iter_all(self):
        """(episode id, entries) of every archived episode, segment by segment (an id in two segments once, from
        the first)."""
        self.refresh()
        # ids of a segment an id's hash points back to (a duplicate, a collision)
        earlier: dict[int, set[str]] = {}
        for number, name in enumerate(self._names):
            path = self.folder / name
            rows = entries_of(pq.read_table(path, columns=raw_columns(path)))
            for (episode_id, entries), numbers in zip(rows, self._index.candidates([e for e, _ in rows])):
                if any(
                    episode_id in earlier.setdefault(n, set(self._ids_of(self._names[n])))
                    for n in numbers
                    if n < number
                ):
                    continue
                yield episode_id, entries

    def sizes(self) -> dict:
        """Segments, episodes and bytes on disk (for status and metrics)."""
        records = read_manifest(self.folder)
        return {
            "segments": len(records),
            "episodes": sum(r.get("episodes", 0) for r in records),
            "bytes": sum(r.get("bytes", 0) for r in records),
            "tokens": sum(r.get("tokens", 0) for r in records),
        }
