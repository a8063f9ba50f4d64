"""Crash points (tests only): a process kills itself (SIGKILL) at a named point of its work.

The environment variable ``FAULT_INJECT_STREAMRL_CRASH`` (not ``STREAMRL_*``: that prefix is configuration) =
``SERVICE:POINT`` or ``SERVICE:POINT@N`` makes that service's process SIGKILL itself the N-th time (default
1) it reaches POINT. Unset in every real run, where ``crash_point`` returns at once. A fault drill sets it on
one process, lets it die exactly there, restarts the service and counts with ``streamrl check``.

The points, in the order each service passes them:

    trainer  stepped    a training step's groups are in the model and its metrics line is written; nothing of
                        it committed (its groups delivered, unacknowledged)
             before_ledger, after_ledger, after_ack  (its commit path: services/trainer/state/commit.py)
             after_publish   the publisher's thread sent a version event
             snapshot_write  the snapshot's thread wrote a snapshot's temporary file, not renamed into place
    rollout  opened     a group's episodes have their 'started' events in their streams, nothing generated
             flushed    an engine step's tokens were written to their streams
             finished   every episode of a group has its end in its stream; the group is not published yet
             repack_stopped  a group chosen for a long-tail repack: its episodes' 'aborted' events are in their
                        streams, its prompt entry is still this worker's
             repack_handed   ... its prompt entry is the long-tail worker's, the notice written; not forgotten here
             paused     a sync's pause was obeyed and acknowledged; the load has not come (a worker dying mid-update)
             pull_leased  sync_mode pull: the worker holds the load lease; nothing paused or loaded yet
             delta_fetched  a chain of weight deltas is fetched and checked; nothing applied or written yet
    syncer   fetch, pause, load, resume   the command was sent; no worker's acknowledgement was awaited
    archiver written, listed, deleting, deleted   a segment renamed into place / listed in the manifest / half
             of its streams deleted / all of them (services/archiver/mover.py)
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "FAULT_INJECT_STREAMRL_CRASH"
POINTS = {
    "trainer": ("stepped", "before_ledger", "after_ledger", "after_ack", "after_publish", "snapshot_write"),
    "rollout": (
        "opened",
        "flushed",
        "finished",
        "repack_stopped",
        "repack_handed",
        "paused",
        "pull_leased",
        "delta_fetched",
    ),
    "syncer": ("fetch", "pause", "load", "resume"),
    # rq handed the job over; the episode is not yet recorded in agents:running
    "agents": ("job_started",),
    "archiver": ("written", "listed", "deleting", "deleted"),
}
_reached: Counter = Counter()


def parse(spec: str) -> tuple[str, str, int]:
    """``SERVICE:POINT[@N]`` -> (service, point, n); ValueError naming what is wrong."""
    where, _, nth = spec.partition("@")
    service, _, point = where.partition(":")
    if point not in POINTS.get(service, ()):
        known = "; ".join(f"{s}: {', '.join(p)}" for s, p in POINTS.items())
        raise ValueError(f"{ENV}={spec!r}: expected SERVICE:POINT[@N] with one of {known}")
    if nth and not (nth.isdigit() and int(nth) >= 1):
        raise ValueError(f"{ENV}={spec!r}: N must be a whole number >= 1, got {nth!r}")
    return service, point, int(nth or 1)


def crash_point(service: str, point: str) -> None:
    """SIGKILL this process if the environment names this point and this is its N-th passage."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return
    want = parse(spec)
    if want[:2] != (service, point):
        return
    _reached[(service, point)] += 1
    if _reached[(service, point)] == want[2]:
        os.kill(os.getpid(), signal.SIGKILL)


def spec(service: str, point: str, n: int = 1) -> dict[str, str]:
    """The environment entry that selects a crash point (for tests' subprocess environments)."""
    parse(f"{service}:{point}@{n}")
    return {ENV: f"{service}:{point}@{n}"}
