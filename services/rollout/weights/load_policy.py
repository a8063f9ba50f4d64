"""When a worker that pulls its weights (``sync_mode = pull``) loads a version it has downloaded: a pure function,
no Redis, no engine (services/rollout/weights/puller.py applies it between engine steps, then asks for the load lease).

A load pauses this worker's generation (abort, load, resume by replay), so it is cheapest when little is running:

    behind   the gate is complete for a newer version than it runs: every other live worker moved on while it
             counted as dead (a stalled heartbeat); it catches up first
    gated    the last claim got nothing under this worker's version (the gate's per-worker limit is spent):
             its slots empty out and stay empty until it runs a newer version
    idle     nothing is generating
    quiet    fewer than ``below`` x its slots hold generating groups
    overdue  the version was announced ``max_wait_s`` ago or more (a worker never quiet still moves on)

None: keep generating, ask again after the next step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class State:
    """What the policy sees of a worker with a verified download of a newer version than it runs."""

    # its last claim was refused by the gate under its own version
    gated: bool
    # slots held by groups still generating
    busy_slots: float
    # max_groups_in_flight
    slots: int
    # since the version was announced (published)
    waited_s: float
    # the gate is complete for a version newer than the one it runs
    behind: bool = False


def decide(s: State, below: float, max_wait_s: float) -> str | None:
    """The reason to load now (behind, gated, idle, quiet, overdue), or None to go on generating."""
    if s.behind:
        return "behind"
    if s.gated:
        return "gated"
    if s.busy_slots <= 0:
        return "idle"
    if s.busy_slots < below * s.slots:
        return "quiet"
    if s.waited_s >= max_wait_s:
        return "overdue"
    return None
