"""A validation round's group ids, ``val-v<version>-g<i>`` (greedy) and ``val-v<version>-s<i>`` (sampled): made by
the driver's validation (services/driver/validation.py), read by it and by the archiver, which moves a round's
episodes out of Redis once the round is ``log_retention_versions`` behind the newest commit."""

from __future__ import annotations


def group_id(version: int, kind: str, index: int) -> str:
    """``kind``: "greedy" or "sampled"."""
    return f"val-v{version:05d}-{'g' if kind == 'greedy' else 's'}{index:03d}"


def parse_group_id(group_id: str) -> tuple[int, str] | None:
    """``val-v00005-g003`` -> (5, "greedy"); None for anything else."""
    parts = group_id.split("-")
    if len(parts) != 3 or parts[0] != "val" or not parts[1].startswith("v") or parts[2][:1] not in ("g", "s"):
        return None
    try:
        return int(parts[1][1:]), "greedy" if parts[2][0] == "g" else "sampled"
    except ValueError:
        return None
