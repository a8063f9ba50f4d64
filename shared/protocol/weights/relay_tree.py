"""The relay tree: which worker fetches a version from which, one rule for the syncer (``sync_mode`` rolling: it
sends the fetch level by level) and for a worker that pulls (``sync_mode`` pull: it asks its own parent).

Nodes are the live rollout workers, relaying ones first (sorted by id), then the others (sorted); node j (1-based;
0 is the trainer) hangs under node (j - 1) // ``fanout``. A worker whose parent is the trainer, or a worker that
does not relay, fetches from the trainer: ``None``.

Workers that download into one shared folder (``folders``: several workers on one host) are one node: the first
of them to take the folder's lock downloads for all (``shared/runtime/weights/fetch.py``), so none of them may fetch
from another of them: the one holding the lock would wait for a copy that waits for the lock. The node serves
through its first relaying worker, and each of its workers fetches from the node's parent.
"""

from __future__ import annotations


def order(workers, relays) -> list[str]:
    """The tree's nodes in order: relaying workers nearer the root."""
    relays = set(relays)
    return sorted(relays) + sorted(set(workers) - relays)


def parents(workers, relays, fanout: int, folders: dict[str, str] | None = None) -> dict[str, str | None]:
    """{worker: the relaying worker it fetches from, or None (the trainer)} over ``workers`` (ids), of which
    ``relays`` serve their copies. ``folders``: {worker: the identity of the folder it downloads into}; workers
    with the same one are one node (a worker without one is a node of its own)."""
    if fanout < 1:
        raise ValueError(f"relay tree: fanout must be >= 1, got {fanout}")
    relays, folders = set(relays), folders or {}
    members: dict[str, list[str]] = {}
    for w in sorted(set(workers)):
        members.setdefault(folders.get(w) or f"worker:{w}", []).append(w)
    # each node is named by the worker that serves for it: its first relaying member, else its first member
    head = {key: min((w for w in ws if w in relays), default=ws[0]) for key, ws in members.items()}
    nodes = order(head.values(), relays & set(head.values()))
    up_of: dict[str, str | None] = {}
    for j, w in enumerate(nodes, start=1):
        up = (j - 1) // fanout
        up_of[w] = nodes[up - 1] if up and nodes[up - 1] in relays else None
    return {w: up_of[head[key]] for key, ws in members.items() for w in ws}


def depths(parent: dict[str, str | None]) -> dict[str, int]:
    """{worker: its level}: 1 under the trainer, 2 under a level-1 relay, ..."""
    out: dict[str, int] = {}

    def depth(w: str) -> int:
        if w not in out:
            out[w] = 1 if parent[w] is None else depth(parent[w]) + 1
        return out[w]

    for w in parent:
        depth(w)
    return out
