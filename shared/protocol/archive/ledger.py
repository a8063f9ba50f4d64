"""The trainer's ledger of committed samples: ``<run_dir>/<run>/trainer/trained.jsonl``.

One JSON line per commit, appended and fsynced before any of its samples is acknowledged: the line is the commit
(services/trainer/state/commit.py). ``{"commit": V, "version": V, "step": S, "groups": [ids trained], "skipped": [ids
not trained], "batches": [[[group, episodes], ...] per step, in order], "counts": {...}}`` (lines written for groups
judged untrainable between commits have no ``commit``). A restart re-trains the commits after its newest snapshot from
``batches``. Each group id appears in ``groups`` at most once across crashes and restarts; ``streamrl check`` reads it
to count groups trained twice or lost.

A crash mid-append leaves a torn last line (no newline, maybe not JSON): ``read_ledger`` ignores it
and ``repair_ledger`` cuts it off before the next append.
"""

from __future__ import annotations

from pathlib import Path

from shared.protocol.archive import jsonl

FILE = "trained.jsonl"
# beside it: one line per trainer restore that re-trained versions from the log (services/trainer/state/replay.py):
# {"snapshot": S, "replayed": [versions], "differing": [versions hashed otherwise], "published": [...], ...}
REPLAYS = "replays.jsonl"


def append_ledger(directory: Path, record: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    jsonl.append(directory / FILE, record)


def read_replays(directory: Path) -> list[dict]:
    return jsonl.read(Path(directory) / REPLAYS, "replays")


def read_ledger(directory: Path) -> list[dict]:
    """Every complete line; a torn last line (no trailing newline) is ignored. A bad complete line is an error."""
    return jsonl.read(directory / FILE, "ledger")


class LedgerTail:
    """The ledger of a running trainer, read as it grows: each ``read`` parses only the lines appended since the
    last (a long run's ledger has a line per step) and returns every line so far, less what ``keep`` let go."""

    def __init__(self, directory: Path):
        self.path, self.records, self.offset = Path(directory) / FILE, [], 0

    def read(self) -> list[dict]:
        new, self.offset = jsonl.read_from(self.path, self.offset, "ledger")
        self.records += new
        return self.records

    def keep(self, records: list[dict]) -> None:
        """Hold only ``records`` of what was read (a reader done with the rest); later reads append to them."""
        self.records = list(records)


def repair_ledger(directory: Path) -> int:
    """Cut a torn last line off (a crash mid-append); return the bytes removed (0: nothing torn)."""
    return jsonl.repair(directory / FILE)


def last_commit(records: list[dict]) -> int:
    """The newest ``commit`` in the ledger (0: none)."""
    return max((int(r["commit"]) for r in records if "commit" in r), default=0)
