"""`python -m services.rollout`: one rollout worker process."""

from __future__ import annotations

import sys

from services.rollout.engine import EngineError, make_engine
from services.rollout.worker import RolloutWorker
from shared.runtime.service import Service


def main(argv=None) -> None:
    svc = Service("rollout", argv)
    from transformers import AutoTokenizer

    from shared.runtime.models import ModelNotFound, resolve_model

    try:
        model_dir = resolve_model(svc.cfg.model_dir)
        engine = make_engine(
            svc.cfg.engine,
            model_dir,
            device=svc.cfg.device_of("rollout"),
            max_batch_size=svc.cfg.max_batch_size,
            vllm_args=svc.cfg.vllm_args,
            step_delay_ms=svc.cfg.step_delay_ms,
            load_delay_ms=svc.cfg.simulated_load_ms,
            routing_replay=svc.cfg.routing_replay,
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (EngineError, OSError, ModelNotFound) as exc:
        svc.log.error("cannot start the engine", model_dir=svc.cfg.model_dir, error=str(exc))
        sys.exit(2)
    try:
        worker = RolloutWorker(svc.cfg, svc.client, svc.worker_id, engine, tokenizer, svc.log)
    # a tools or reward_fn spec that does not load
    except ValueError as exc:
        svc.log.error("bad config", error=str(exc))
        sys.exit(2)
    svc.log.info("ready", engine=svc.cfg.engine, model_dir=svc.cfg.model_dir, version=engine.version)
    worker.run(should_stop=lambda: svc.stopping)


if __name__ == "__main__":
    main()
