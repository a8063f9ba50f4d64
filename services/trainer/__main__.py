"""`python -m services.trainer`: the trainer process (one per run)."""

from services.trainer.trainer import Trainer
from shared.runtime.service import Service


def main(argv=None) -> None:
    svc = Service("trainer", argv)
    trainer = Trainer(svc.cfg, svc.client, svc.log)
    svc.log.info("ready", model_dir=svc.cfg.model_dir, loss=svc.cfg.loss, batch_groups=svc.cfg.batch_groups)
    svc.heartbeat(ttl=3600)
    trainer.run(should_stop=lambda: svc.stopping)


if __name__ == "__main__":
    main()
