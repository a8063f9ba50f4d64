"""Metrics to Weights & Biases (``wandb = "online"`` or ``"offline"``), beside TensorBoard and the JSONL file.

Each process that reports (trainer, driver) is its own wandb run named ``<run>-<process>``, grouped under the
streamrl run's name in project ``wandb_project``; files go to ``<run_dir>/<run>/wandb``. ``offline`` writes
them locally only (``wandb sync`` uploads them later)."""

from __future__ import annotations

from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config


class WandbSink:
    def __init__(self, cfg: Config, process: str):
        self.run = None
        if not cfg.wandb:
            return
        if cfg.wandb not in ("online", "offline"):
            raise ConfigError(f"config key 'wandb': expected 'online', 'offline' or empty, got {cfg.wandb!r}")
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "config key 'wandb' is set but the wandb package is not installed: pip install '.[wandb]'"
            ) from None
        folder = cfg.run_path / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.wandb_project,
            name=f"{cfg.run}-{process}",
            group=cfg.run,
            job_type=process,
            mode=cfg.wandb,
            dir=str(folder),
            reinit="create_new",
            config={k: v for k, v in vars(cfg).items() if k != "redis_url"},
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log({**metrics, "step": step})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
