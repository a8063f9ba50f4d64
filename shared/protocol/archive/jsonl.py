"""Append-only JSON-lines files that survive a kill at any byte: the trainer's ledger and the episode segments'
manifest. One line per record, appended and fsynced; a crash mid-append leaves a torn last line (no newline,
maybe not JSON), which ``read`` ignores and ``repair`` cuts off before the next append. A bad *complete* line is
an error naming the file and the line. ``fsync_dir`` makes a rename in a folder durable."""

from __future__ import annotations

import json
import os
from pathlib import Path


def append(path: Path, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read(path: Path, what: str) -> list[dict]:
    """Every complete line of ``path`` (``what`` names the file in errors); [] when it does not exist."""
    if not path.exists():
        return []
    # after the last newline: empty or torn
    return _parse(path.read_text().split("\n")[:-1], path, what)


def _parse(lines, path: Path, what: str, near_end: bool = False) -> list[dict]:
    """The JSON lines of ``lines`` (blank ones skipped); a line that is not JSON is a ValueError naming it."""
    out = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                where = "a line near its end" if near_end else f"line {number}"
                raise ValueError(f"{what} {path}: {where} is not JSON ({exc})") from None
    return out


def tail(path: Path, nbytes: int, what: str) -> list[dict]:
    """The complete lines in the last ``nbytes`` of ``path`` (the first one there, maybe cut, skipped unless the
    file starts there); [] when it does not exist. Reads ``nbytes`` at most, however long the file."""
    if not path.exists():
        return []
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - nbytes))
        lines = fh.read().split(b"\n")[:-1]
    return _parse(lines[1:] if size > nbytes else lines, path, what, near_end=True)


def repair(path: Path) -> int:
    """Cut a torn last line off (a crash mid-append); the bytes removed (0: nothing torn, or no file)."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep == len(data):
        return 0
    with open(path, "r+b") as fh:
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    return len(data) - keep


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_from(path: Path, offset: int, what: str) -> tuple[list[dict], int]:
    """The complete lines after byte ``offset`` and the offset after the last of them (a reader that keeps up with
    a growing file reads each line once). A file shorter than ``offset`` (cut by ``repair``: only a torn line, never
    a complete one, so only when a reader's offset is past the file's end) reads from where it now ends."""
    if not path.exists():
        return [], 0
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        offset = min(offset, size)
        fh.seek(offset)
        data = fh.read(size - offset)
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].split(b"\n")[:-1]:
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{what} {path}: a line after byte {offset} is not JSON ({exc})") from None
    return out, offset + end
