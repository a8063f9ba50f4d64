"""Which commits a restart trains again, and with what: pure functions over the ledger's lines.

The trainer's state at version V is its newest snapshot S plus the commits S+1 .. V of the ledger, each re-trained
step by step from the logged episodes of the groups its line names, in the order they trained, with the run's own
config (the same loss, minibatches and learning rate). Training on the CPU path is deterministic, so each re-derived
version's weights hash to the sha256 its version event holds; where they do not (a non-deterministic kernel), the
trainer says so, records it, and goes on from its re-derived weights (docs/faults.md).
"""

from __future__ import annotations


class ReplayError(ValueError):
    """The ledger cannot be re-trained from the snapshot: the message names the version and what is missing."""


def commits_after(records: list[dict], snapshot_version: int) -> list[dict]:
    """The commit lines after ``snapshot_version``, in order. ReplayError when one is missing (a gap in the commits) or
    a line has no ``batches`` (written before replay existed: such a run restores only from a snapshot level with its
    ledger)."""
    lines = sorted((r for r in records if "commit" in r and int(r["commit"]) > snapshot_version), key=_commit)
    for expected, line in enumerate(lines, start=snapshot_version + 1):
        if _commit(line) != expected:
            raise ReplayError(
                f"ledger: commit {expected} is missing (the next line is commit {_commit(line)}); the snapshot is at "
                f"version {snapshot_version}, so versions after it cannot be re-trained"
            )
        if "batches" not in line:
            raise ReplayError(
                f"ledger: commit {expected} has no 'batches' (written by an older trainer) and the newest snapshot is "
                f"at version {snapshot_version}: nothing to re-train it from"
            )
    return lines


def steps_of(line: dict) -> list[list[tuple[str, list[str]]]]:
    """A commit line's training steps, each a list of (group id, episode ids) in the order they trained."""
    steps = []
    for batch in line["batches"]:
        step = []
        for group_id, episodes in batch:
            eids = [f"{group_id}-{i}" for i in range(episodes)] if isinstance(episodes, int) else list(episodes)
            step.append((group_id, eids))
        steps.append(step)
    return steps


def summary(snapshot_version: int, replayed: list[int], differing: list[int], published: list[int]) -> dict:
    """The line a restore appends to ``replays.jsonl`` (``streamrl check`` sums them)."""
    return {
        "snapshot": snapshot_version,
        "replayed": replayed,
        "differing": differing,
        "published": published,
    }


def _commit(line: dict) -> int:
    return int(line["commit"])
