"""Which listed segment may hold an episode, in ~12 bytes an archived episode: its id's 64-bit hash (Python's own
string hash, so the index never leaves its process), sorted, beside its segment's number. A dict of ids held ~107
bytes an episode, and a run of days archives millions of them, in each process that reads segments (the archiver,
the driver, the CLI). Two ids may share a hash (about n^2 / 2^65 pairs among n ids): a lookup then names a segment
that does not hold the episode, and the reader finds nothing there; ``SegmentStore`` reads each candidate."""

from __future__ import annotations

import numpy as np


def hashes(episode_ids: list[str]) -> np.ndarray:
    return np.fromiter(map(hash, episode_ids), np.int64, len(episode_ids))


class SegmentIndex:
    def __init__(self):
        # sorted
        self.keys = np.zeros(0, np.int64)
        # the segment number of each; equal keys in the order they were added
        self.where = np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, number: int, episode_ids: list[str]) -> None:
        """Index a segment's episodes (segments are added in listing order, ``number`` rising): a merge into the
        sorted keys, one copy of them."""
        new = np.sort(hashes(episode_ids))
        # after equal keys of earlier segments
        at = np.searchsorted(self.keys, new, side="right")
        self.keys = np.insert(self.keys, at, new)
        self.where = np.insert(self.where, at, np.full(len(new), number, np.int32))

    def candidates(self, episode_ids: list[str]) -> list[list[int]]:
        """For each id, the numbers of the segments that may hold it, in listing order (usually none or one)."""
        if not len(self.keys) or not episode_ids:
            return [[] for _ in episode_ids]
        h = hashes(episode_ids)
        lo, hi = np.searchsorted(self.keys, h, "left"), np.searchsorted(self.keys, h, "right")
        first = self.where[np.minimum(lo, len(self.keys) - 1)].tolist()
        out = []
        for a, b, n in zip(lo.tolist(), hi.tolist(), first):
            out.append([] if a == b else [n] if b - a == 1 else self.where[a:b].tolist())
        return out

    def may_hold(self, episode_ids: list[str]) -> np.ndarray:
        """For each id, whether a listed segment may hold it (bools; a hash shared with another id says yes)."""
        if not len(self.keys) or not episode_ids:
            return np.zeros(len(episode_ids), bool)
        h = hashes(episode_ids)
        at = np.minimum(np.searchsorted(self.keys, h), len(self.keys) - 1)
        return self.keys[at] == h
