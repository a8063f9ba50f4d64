"""`streamrl ui`: serve the app (app.py) on ``ui_host``:``ui_port`` until interrupted; every served copy of an
ended run's data is stopped on the way out."""

from __future__ import annotations

import sys

import structlog
import uvicorn

from services.ops.ui.app import make_app
from services.ops.ui.sources import Sources


def serve(cfg, sources: dict) -> int:
    runs = Sources(cfg, sources)
    app = make_app(runs, cfg.gateway_api_key, runs.is_live)
    start = f"/run/{cfg.run}" if "run" in sources else "/"
    key = f"?key={cfg.gateway_api_key}" if cfg.gateway_api_key else ""
    print(f"streamrl ui: http://{cfg.ui_host}:{cfg.ui_port}{start}{key}  (runs under {cfg.run_dir}; read-only; "
          f"Ctrl-C stops it)", file=sys.stderr, flush=True)
    structlog.get_logger("ui").info("listening", host=cfg.ui_host, port=cfg.ui_port, keyed=bool(key))
    try:
        uvicorn.run(app, host=cfg.ui_host, port=cfg.ui_port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        runs.close()
    return 0
