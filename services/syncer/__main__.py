"""`python -m services.syncer`: placeholder loop until the syncer issue lands; it joins the run,
heartbeats, and stops cleanly on SIGTERM."""

from shared.service import Service


def main(argv=None) -> None:
    svc = Service("syncer", argv)
    svc.log.info("ready")
    while not svc.stopping:
        svc.heartbeat()
        svc.idle(1.0)


if __name__ == "__main__":
    main()
