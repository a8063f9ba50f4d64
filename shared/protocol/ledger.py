"""The trainer's ledger of committed samples: ``<run_dir>/<run>/trainer/trained.jsonl``.

One JSON line per commit, appended and fsynced after the checkpoint that includes it is durable:
``{"version": V, "step": S, "groups": [ids trained], "skipped": [ids dropped as too stale], ...}``.
Each group id appears in ``groups`` at most once across crashes and restarts; ``streamrl check``
reads it to count groups trained twice or lost.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def append_ledger(directory: Path, record: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "trained.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_ledger(directory: Path) -> list[dict]:
    path = directory / "trained.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
