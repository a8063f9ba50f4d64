"""`python -m services.archiver`: moves trained episodes older than ``log_retention_versions`` out of Redis."""

import os
import time

from services.archiver.mover import Mover
from shared.runtime.service import Service


def main(argv=None) -> None:
    svc = Service("archiver", argv)
    cfg = svc.cfg
    # the move takes the CPU the pipeline leaves idle (docs/operations.md): raised to archiver_nice, never lowered
    niceness = os.nice(max(0, cfg.archiver_nice - os.nice(0)))
    mover = Mover(svc.client, svc.keys, cfg.run_path, cfg.log_retention_versions, log=svc.log,
                  seed_base=cfg.seed)
    recovered = mover.recover()
    svc.log.info("archiver started", retention_versions=cfg.log_retention_versions, recovered=recovered,
                 niceness=niceness)
    while not svc.stopping:
        if cfg.log_retention_versions > 0:
            mover.step()
        deadline = time.monotonic() + cfg.archive_every_s
        while not svc.stopping and time.monotonic() < deadline:
            time.sleep(0.2)


if __name__ == "__main__":
    main()
