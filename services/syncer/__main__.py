"""`python -m services.syncer`: weight sync and the staleness gate."""

from services.syncer.syncer import Syncer
from shared.service import Service


def main(argv=None) -> None:
    svc = Service("syncer", argv)
    svc.heartbeat(ttl=3600)
    Syncer(svc.cfg, svc.client, svc.log).run(should_stop=lambda: svc.stopping)


if __name__ == "__main__":
    main()
