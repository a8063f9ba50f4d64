"""`python -m services.archiver`: moves trained episodes older than ``log_retention_versions`` out of Redis.

It steps every ``archive_every_versions`` published versions (woken by the ``versions`` stream: a blocking read, no
polling, after a rest of most of the time those versions took last time), and at the latest ``archive_every_s``
after its last step (``cadence.py``)."""

import os
import time

from services.archiver import cadence
from services.archiver.mover import Mover
from shared.protocol.streams import versions
from shared.runtime.service import Service


def follow(client, keys, cursor: str, newest: int, block_ms: int | None = None) -> tuple[str, int]:
    """(cursor, newest version) after reading the versions published since ``cursor``; waits up to ``block_ms``
    for one when none is there (None: no wait)."""
    while True:
        found = versions.read_after(client, keys, cursor, block_ms=block_ms, count=1000)
        if not found:
            return cursor, newest
        cursor, newest, block_ms = found[-1].entry_id, max(newest, *(v.version for v in found)), None


def main(argv=None) -> None:
    svc = Service("archiver", argv)
    cfg = svc.cfg
    # the move takes the CPU the pipeline leaves idle (docs/operations.md): raised to archiver_nice, never lowered
    niceness = os.nice(max(0, cfg.archiver_nice - os.nice(0)))
    mover = Mover(svc.client, svc.keys, cfg.run_path, cfg.log_retention_versions, log=svc.log, seed_base=cfg.seed)
    recovered = mover.recover()
    svc.log.info(
        "archiver started",
        retention_versions=cfg.log_retention_versions,
        recovered=recovered,
        niceness=niceness,
        every_versions=cfg.archive_every_versions,
        every_s=cfg.archive_every_s,
    )
    latest = versions.latest(svc.client, svc.keys)
    cursor, newest = (latest.entry_id, latest.version) if latest else ("0-0", 0)
    stepped_at = stepped_version = None
    while not svc.stopping:
        # what the step acts on
        cursor, newest = follow(svc.client, svc.keys, cursor, newest)
        if cfg.log_retention_versions > 0:
            mover.step()
        now = time.monotonic()
        rest = (
            0.0
            if stepped_at is None
            else cadence.rest_s(
                newest - stepped_version, now - stepped_at, cfg.archive_every_versions, cfg.archive_every_s
            )
        )
        stepped_at, stepped_version = now, newest
        while not svc.stopping and time.monotonic() - stepped_at < rest:
            time.sleep(min(rest - (time.monotonic() - stepped_at), cadence.MAX_BLOCK_MS / 1000))
        while not svc.stopping and not cadence.due(
            newest, stepped_version, time.monotonic() - stepped_at, cfg.archive_every_versions, cfg.archive_every_s
        ):
            wait = cadence.block_ms(time.monotonic() - stepped_at, cfg.archive_every_s)
            cursor, newest = follow(svc.client, svc.keys, cursor, newest, block_ms=wait)


if __name__ == "__main__":
    main()
