"""The long-tail repack policy: pure functions, no Redis, no engine (services/rollout/groups/repacker.py applies them).

When most of a normal worker's batch has finished and a few long episodes remain, its engine steps a
near-empty batch until they end, and it holds those groups' slots meanwhile. The policy says which groups to
hand to a long-tail worker (``choose``), which live long-tail worker takes them (``pick_target``), and how
much of a long-tail worker's capacity new groups may fill (``claim_cap``). Off unless ``repack_below`` > 0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupTail:
    """One group a worker holds, as the policy sees it."""

    group_id: str
    # tokens generated so far by each of its episodes generating here
    generating: tuple[int, ...]
    # its episodes waiting on a tool or reward job (a group with any stays: its job is running)
    waiting: int = 0


def capacity(max_batch_size: int, max_groups_in_flight: int, group_size: int) -> int:
    """Episodes a worker generates at once when full."""
    return max(1, min(max_batch_size, max_groups_in_flight * group_size))


def choose(groups: list[GroupTail], capacity: int, below: float, min_tokens: int, room: int) -> list[str]:
    """The groups to repack, longest tail first, at most ``room`` (what the target can take): none unless the
    worker's generating episodes are at most ``below`` x ``capacity`` (and some are); a group qualifies when
    every one of its live episodes is generating and one has at least ``min_tokens`` tokens."""
    if below <= 0 or room <= 0:
        return []
    generating = sum(len(g.generating) for g in groups)
    if generating == 0 or generating > below * capacity:
        return []
    movable = [g for g in groups if g.generating and not g.waiting and max(g.generating) >= min_tokens]
    movable.sort(key=lambda g: (-max(g.generating), g.group_id))
    return [g.group_id for g in movable[:room]]


def pick_target(workers: dict[str, dict[str, str]], me: str) -> tuple[str, int] | None:
    """(worker id, room) of the live long-tail worker with the most room, ``me`` excluded (ties: the first by
    id); None when none has room. ``workers``: heartbeat fields by worker id (``heartbeat.alive_of``)."""
    best = None
    for name in sorted(workers):
        fields = workers[name]
        if name == me or fields.get("role") != "longtail" or fields.get("paused", "0") == "1":
            continue
        try:
            room = int(fields.get("room", "0"))
        except ValueError:
            continue
        if room > 0 and (best is None or room > best[1]):
            best = (name, room)
    return best


def claim_cap(role: str, max_groups_in_flight: int, longtail_claim_share: float) -> int:
    """Slots a worker fills with new groups: all of them, or a long-tail worker's share (rounded half up), so
    the rest stays free for repacked groups (repacks and takeovers may use every slot)."""
    if role != "longtail":
        return max_groups_in_flight
    return min(max_groups_in_flight, int(max_groups_in_flight * longtail_claim_share + 0.5))
