"""The relay tree: which worker fetches a version from which, one rule for the syncer (``sync_mode`` rolling: it
sends the fetch level by level) and for a worker that pulls (``sync_mode`` pull: it asks its own parent).

Nodes are the live rollout workers, relaying ones first (sorted by id), then the others (sorted); node j (1-based;
0 is the trainer) hangs under node (j - 1) // ``fanout``. A worker whose parent is the trainer, or a worker that
does not relay, fetches from the trainer: ``None``.
"""

from __future__ import annotations


def order(workers, relays) -> list[str]:
    """The tree's nodes in order: relaying workers nearer the root."""
    relays = set(relays)
    return sorted(relays) + sorted(set(workers) - relays)


def parents(workers, relays, fanout: int) -> dict[str, str | None]:
    """{worker: the relaying worker it fetches from, or None (the trainer)} over ``workers`` (ids), of which
    ``relays`` serve their copies."""
    if fanout < 1:
        raise ValueError(f"relay tree: fanout must be >= 1, got {fanout}")
    relays = set(relays)
    nodes = order(workers, relays)
    out: dict[str, str | None] = {}
    for j, w in enumerate(nodes, start=1):
        up = (j - 1) // fanout
        out[w] = nodes[up - 1] if up and nodes[up - 1] in relays else None
    return out


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
