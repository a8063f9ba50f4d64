"""`streamrl ui`: serve the app (app.py) on ``ui_host``:``ui_port`` until interrupted; every served copy of an
ended run's data is stopped on the way out."""

from __future__ import annotations

import signal
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
    print(
        f"streamrl ui: http://{cfg.ui_host}:{cfg.ui_port}{start}{key}  (runs under {cfg.run_dir}; read-only; "
        f"Ctrl-C stops it)",
        file=sys.stderr,
        flush=True,
    )
    structlog.get_logger("ui").info("listening", host=cfg.ui_host, port=cfg.ui_port, keyed=bool(key))
    # uvicorn stops on SIGTERM, then raises it again through the handler it found: a handler that raises (rather
    # than the default, which ends the process at once) lets the served copies below be stopped
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        uvicorn.run(app, host=cfg.ui_host, port=cfg.ui_port, log_level="warning", timeout_graceful_shutdown=2)
    except SystemExit:
        pass
    finally:
        runs.close()
        signal.signal(signal.SIGTERM, previous)
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)
