"""`python -m services.rollout`: placeholder loop until the rollout issue lands; it joins the run,
heartbeats, and stops cleanly on SIGTERM."""

from shared.service import Service


def main(argv=None) -> None:
    svc = Service("rollout", argv)
    svc.log.info("ready")
    while not svc.stopping:
        svc.heartbeat()
        svc.idle(1.0)


if __name__ == "__main__":
    main()
