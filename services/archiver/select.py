"""Which episodes may leave Redis (pure): those of groups in a committed ledger line of a version at least
``retention`` versions older than the newest commit. A group in the ledger was published (every episode of it
ended, its prompt acknowledged) and trained or judged untrainable: no worker writes to it again (one that wakes
up late is fenced: its stream's length is not the seq it expects, and a deleted stream has length 0)."""

from __future__ import annotations

from shared.protocol.streams.val_groups import parse_group_id


def newest_commit(ledger: list[dict]) -> int:
    return max((int(r["commit"]) for r in ledger if "commit" in r), default=0)


def old_groups(ledger: list[dict], retention: int) -> list[str]:
    """Group ids of committed ledger lines with ``version <= newest commit - retention`` (trained or skipped)."""
    if retention <= 0:
        return []
    cutoff = newest_commit(ledger) - retention
    out = []
    for r in ledger:
        if "commit" in r and int(r.get("version", r["commit"])) <= cutoff:
            out += [*r.get("groups", []), *r.get("skipped", [])]
    return out


def still_needed(ledger: list[dict], episodes_of: dict[str, list[str]], retention: int) -> list[dict]:
    """The ledger lines a later step can still act on: the newest ``retention`` versions' (not due yet) and any with
    a group not moved whole yet (still in ``episodes_of``). The rest are done for good: a long run's archiver holds
    and scans a window of the ledger, not every line of it."""
    cutoff = newest_commit(ledger) - retention
    return [
        r
        for r in ledger
        if "commit" in r
        and (
            int(r.get("version", r["commit"])) > cutoff
            or any(g in episodes_of for g in (*r.get("groups", ()), *r.get("skipped", ())))
        )
    ]


def due_groups(ledger: list[dict], episodes_of: dict[str, list[str]], retention: int) -> list[str]:
    """The groups whose episodes may move now: old groups (``old_groups``) known from the samples stream
    (``episodes_of``: group id -> its episode ids)."""
    return list(dict.fromkeys(g for g in old_groups(ledger, retention) if g in episodes_of))


def due_val_groups(val_episodes_of: dict[str, list[str]], newest: int, retention: int) -> list[str]:
    """The validation rounds' groups whose episodes may move now: groups published to ``samples:val`` (every
    episode ended, the prompt acknowledged; no trainer reads them) of a round ``retention`` versions or more before
    ``newest``, the newest commit. The driver reads a round's episodes from either tier."""
    if retention <= 0:
        return []
    return [g for g in val_episodes_of if (parsed := parse_group_id(g)) is not None and parsed[0] <= newest - retention]
