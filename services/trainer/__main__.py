"""`python -m services.trainer`: the trainer process (one per run), or `torchrun --nproc-per-node N -m
services.trainer`: N data-parallel ranks, rank 0 the trainer the rest of the pipeline sees (docs/training.md)."""

from services.trainer import distributed
from services.trainer.trainer import Trainer
from shared.runtime.service import Service


def main(argv=None) -> None:
    svc = Service("trainer", argv)
    trainer = Trainer(svc.cfg, svc.client, svc.log)
    try:
        if not trainer.shard.main:  # under torchrun: rank 0 reads, commits and beats; this rank follows it
            trainer.run()
            return
        svc.log.info("ready", model_dir=svc.cfg.model_dir, loss=svc.cfg.loss, batch_groups=svc.cfg.batch_groups,
                     world_size=trainer.shard.size)
        beat = svc.heartbeat(ttl=max(10.0, 2 * svc.cfg.heartbeat_ttl))
        beat.beat()
        try:
            def should_stop() -> bool:  # the trainer's loop asks often: the heartbeat is refreshed there
                beat.beat()
                return svc.stopping

            trainer.run(should_stop=should_stop)
        finally:
            beat.stop()
    finally:
        distributed.close()


if __name__ == "__main__":
    main()
