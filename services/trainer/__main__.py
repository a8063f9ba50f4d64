"""`python -m services.trainer`: the trainer process (one per run), or `torchrun --nproc-per-node N -m
services.trainer`: N data-parallel ranks, rank 0 the trainer the rest of the pipeline sees (docs/training.md)."""

import sys

from services.trainer import distributed
from services.trainer.trainer import Trainer
from shared.runtime.service import Service
from shared.runtime.weights.server import WeightServer


def serve_weights(cfg, log, resolve=None) -> WeightServer | None:
    """With weights_port > 0, the published folder over HTTP from a thread of this process (rank 0's under
    torchrun): the server is up exactly while versions are published, on the host that holds the files.
    ``resolve``: the publisher's lookup (a version being written is waited for, a full file not written is made from
    the deltas: services/trainer/publisher.py)."""
    if not cfg.weights_port:
        return None
    cfg.weights_path.mkdir(parents=True, exist_ok=True)
    server = WeightServer(
        cfg.weights_path, cfg.weights_host, cfg.weights_port, cfg.weights_token, resolve=resolve
    ).start()
    log.info(
        "serving weights",
        listen=server.url,
        advertised=cfg.weights_base_url,
        folder=str(cfg.weights_path),
        auth=bool(cfg.weights_token),
    )
    return server


def main(argv=None) -> None:
    svc = Service("trainer", argv)
    trainer = Trainer(svc.cfg, svc.client, svc.log)
    server, clean = None, False
    try:
        # under torchrun: rank 0 reads, commits and beats; this rank follows it
        if not trainer.shard.main:
            trainer.run()
            clean = True
            return
        try:
            server = serve_weights(svc.cfg, svc.log, resolve=trainer.publisher.resolve)
        # address in use, or not an address of this host
        except OSError as exc:
            print(f"trainer: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        svc.log.info(
            "ready",
            model_dir=svc.cfg.model_dir,
            loss=svc.cfg.loss,
            batch_groups=svc.cfg.batch_groups,
            world_size=trainer.shard.size,
        )
        beat = svc.heartbeat(ttl=max(10.0, 2 * svc.cfg.heartbeat_ttl))
        beat.beat()
        try:
            # the trainer's loop asks often: the heartbeat is refreshed there
            def should_stop() -> bool:
                beat.beat()
                return svc.stopping

            trainer.run(should_stop=should_stop)
            clean = True
        finally:
            beat.stop()
    finally:
        if server is not None:
            server.stop()
        distributed.close(sync=clean)


if __name__ == "__main__":
    main()
