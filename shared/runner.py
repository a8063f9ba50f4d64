"""`streamrl run`: the whole job on one machine, from the same Procfile that
`honcho start` uses. Starts the embedded Redis on a free loopback port (unless
REDIS_URL is set, then that server is used and the Procfile's redis line is
skipped), runs every other line under honcho, and ends when the driver ends."""

from __future__ import annotations

import os
import sys
from dataclasses import fields
from pathlib import Path

from honcho.environ import parse_procfile
from honcho.manager import Manager

from shared.config import Config
from shared.connection import redact
from shared.redis_server import EmbeddedRedis


def run(cfg: Config, procfile: str = "Procfile", extra_env: dict | None = None) -> int:
    path = Path(procfile)
    if not path.exists():
        raise FileNotFoundError(f"no Procfile at {path.resolve()}")
    entries = parse_procfile(path.read_text()).processes
    server = None
    # every process gets the very same config: each key as STREAMRL_<KEY>
    env = {**os.environ, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
    env.pop("STREAMRL_CONFIG", None)
    if cfg.device == "cpu":  # several torch processes share the cores: one thread each, not N fighting over N
        env.setdefault("OMP_NUM_THREADS", "1")  # (measured: a tiny model's decode step 4 ms vs 42 ms on 2 cores)
    for f in fields(Config):
        env[f"STREAMRL_{f.name.upper()}"] = str(getattr(cfg, f.name))
    if "REDIS_URL" not in os.environ:
        server = EmbeddedRedis(Path(cfg.run_dir) / cfg.run / "redis").start()
        env["REDIS_URL"] = env["STREAMRL_REDIS_URL"] = server.url
    if not Path(cfg.model_dir, "config.json").exists():
        from shared.tiny_model import ensure_default_model

        ensure_default_model(cfg)
    print(f"streamrl run: run {cfg.run!r} on {redact(env['REDIS_URL'])}"
          f"{' (embedded, append-only)' if server else ''}", file=sys.stderr, flush=True)
    manager = Manager()
    for name, cmd in entries.items():
        if name != "redis":
            manager.add_process(name, cmd, env=env)
    try:
        manager.loop()
    finally:
        if server:
            server.stop()
    return manager.returncode or 0
