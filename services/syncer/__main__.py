"""`python -m services.syncer`: weight sync and the staleness gate."""

from services.syncer.syncer import Syncer
from shared.runtime.service import Service


def main(argv=None) -> None:
    svc = Service("syncer", argv)
    ttl = max(10.0, 2 * svc.cfg.heartbeat_ttl)
    svc.heartbeat(ttl=ttl)
    Syncer(svc.cfg, svc.client, svc.log, heartbeat=lambda: svc.heartbeat(ttl=ttl)).run(
        should_stop=lambda: svc.stopping)


if __name__ == "__main__":
    main()
