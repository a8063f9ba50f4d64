"""Metrics as TensorBoard event files (``tensorboard = true``), beside the JSONL file and the metrics stream,
and to Weights & Biases when ``wandb`` is set (``wandb_sink``).

Each process that reports writes its own event file into ``<run_dir>/<run>/tensorboard``; TensorBoard merges the
files of one folder. Numbers become scalars under ``<prefix>/<name>``; nested maps (the staleness histogram) become
``<prefix>/<name>/<key>``; anything else is skipped.
"""

from __future__ import annotations

import math

from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.wandb_sink import WandbSink


class TensorBoard:
    def __init__(self, cfg: Config, process: str):
        self.writer = None
        # the optional second sink (`wandb` key)
        self.wandb = WandbSink(cfg, process)
        if not cfg.tensorboard:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "config key 'tensorboard' is true but the tensorboard package is not installed: "
                "pip install '.[tensorboard]'"
            ) from None
        self.dir = cfg.run_path / "tensorboard"
        self.writer = SummaryWriter(str(self.dir), filename_suffix=f".{process}")

    def scalars(self, prefix: str, metrics: dict, step: int) -> None:
        self.wandb.log({f"{prefix}/{k}": v for k, v in flatten(metrics).items()}, step)
        if self.writer is None:
            return
        for name, value in flatten(metrics).items():
            self.writer.add_scalar(f"{prefix}/{name}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.wandb.close()
        if self.writer is not None:
            self.writer.close()


def flatten(metrics: dict, prefix: str = "") -> dict[str, float]:
    """Finite numbers of a (nested) metrics map, keyed by their slash-joined path; booleans and text are dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out
