"""`python -m services.syncer`: weight sync and the staleness gate."""

from services.syncer.syncer import Syncer
from shared.runtime.service import Service


def main(argv=None) -> None:
    svc = Service("syncer", argv)
    beat = svc.heartbeat(ttl=max(10.0, 2 * svc.cfg.heartbeat_ttl))
    beat.beat()
    try:
        Syncer(svc.cfg, svc.client, svc.log, heartbeat=beat.beat).run(should_stop=lambda: svc.stopping)
    finally:
        beat.stop()


if __name__ == "__main__":
    main()
