"""`python -m services.gateway`: one gateway process (stateless: run as many as you like)."""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

from services.gateway.app import make_app
from services.gateway.chat import RenderError
from services.gateway.core import Gateway
from shared.runtime.service import Service


def build(cfg, client, log) -> Gateway:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model_dir)
    model_cfg = AutoConfig.from_pretrained(cfg.model_dir)
    max_len = int(getattr(model_cfg, "max_position_embeddings", 2048))
    names = [Path(cfg.model_dir).name, "policy"]
    return Gateway(cfg, client, tok, max_len, names, log)


def main(argv=None) -> None:
    svc = Service("gateway", argv)
    try:
        gw = build(svc.cfg, svc.client, svc.log)
    except (OSError, RenderError) as exc:
        svc.log.error("cannot start the gateway", model_dir=svc.cfg.model_dir, error=str(exc))
        sys.exit(2)
    svc.log.info("listening", host=svc.cfg.gateway_host, port=svc.cfg.gateway_port)
    config = uvicorn.Config(
        make_app(gw, svc.cfg.gateway_api_key),
        host=svc.cfg.gateway_host,
        port=svc.cfg.gateway_port,
        log_level="warning",
        # never written at warning; off, a request does not format its line for nothing
        access_log=False,
        timeout_graceful_shutdown=3,
    )
    Server(config, gw).run()


class Server(uvicorn.Server):
    """uvicorn's server, telling the gateway when it is told to stop: every call held open answers 503 (retry)
    within a second, so the graceful shutdown ends before its timeout instead of cancelling them (tracebacks)."""

    def __init__(self, config, gw: Gateway):
        super().__init__(config)
        self.gw = gw

    def handle_exit(self, sig, frame) -> None:
        self.gw.stopping.set()
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    main()
