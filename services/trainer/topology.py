"""How the trainer is laid out, chosen once at start: one process (``Alone``), or data-parallel ranks under torchrun
(``Ranks``: FSDP2, rank 0 reads samples and tells the other ranks each step; services/trainer/distributed.py).

The training loop calls the same methods on either and never asks which it runs: binding the process (log context,
device), preparing the model, telling the other ranks a command, sharing a step's batch, gathering the weights a
version publishes, and saving and loading the checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from services.trainer import checkpoint, distributed, sharded_checkpoint
from services.trainer.batch import Batch
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config


class Alone:
    """One trainer process: the whole model, ``checkpoint.pt`` (its optimizer written in the background), no ranks
    to tell anything."""

    name = "one process"
    shard = distributed.LOCAL

    def bind(self, cfg: Config, log):
        return cfg, log

    def prepare(self, model) -> None:
        pass

    def tell(self, message: dict) -> None:
        pass

    def keep_alive(self) -> None:
        pass

    def share_batch(self, groups: list, batch: Batch) -> None:
        pass

    def publish_state(self, policy) -> dict[str, torch.Tensor]:
        return policy.publish_state()

    def save(self, ckpt_dir: Path, model, opt, meta: dict) -> None:
        checkpoint.save(ckpt_dir, {"model": model.state_dict(), "rng": torch.get_rng_state(), **meta})
        # the optimizer state (twice the model) in the background: a restore warns when it is older than the model
        checkpoint.save_optimizer(ckpt_dir, meta["version"], opt.state_dict())

    def load(self, ckpt_dir: Path, model, opt) -> dict | None:
        _refuse_the_other_kind(ckpt_dir, self)
        state = checkpoint.load(ckpt_dir)
        if state is not None:
            model.load_state_dict(state["model"])
            if state["optimizer"] is not None:
                opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
        return state


class Ranks:
    """Data-parallel ranks under torchrun: each holds a shard (FSDP2) and writes its part of a sharded checkpoint;
    rank 0 (``shard.main``) reads samples, sends every other rank each command, and publishes."""

    name = "torchrun"

    def __init__(self, cfg: Config):
        if cfg.lora_rank > 0:
            raise ConfigError(
                "config key 'lora_rank': LoRA is not supported under torchrun yet (the published "
                "version merges adapters from unsharded weights); run one trainer process"
            )
        self.shard = distributed.init(torch.device(cfg.device_of("trainer")))
        self.tied: set[str] = set()
        # when rank 0 last sent the other ranks a command
        self._told = time.monotonic()

    def bind(self, cfg: Config, log):
        log = log.bind(rank=self.shard.rank, world_size=self.shard.size)
        # each rank on its own GPU (LOCAL_RANK), whatever cuda:N says
        if self.shard.device.type == "cuda":
            cfg = dataclasses.replace(cfg, trainer_device=str(self.shard.device))
        return cfg, log

    def prepare(self, model) -> None:
        # the same initial weights on every rank (same seed, same files), then sharded
        self.tied = distributed.tied_names(model)
        distributed.shard_model(model)

    def tell(self, message: dict) -> None:
        if self.shard.main:
            distributed.broadcast(self.shard, message)
            self._told = time.monotonic()

    def keep_alive(self) -> None:
        # the other ranks wait in a collective while rank 0 waits for samples: keep each wait short of its timeout
        if time.monotonic() - self._told > distributed.IDLE_EVERY_S:
            self.tell({"op": "idle"})

    def share_batch(self, groups: list, batch: Batch) -> None:
        ids = [(e, g, [ep.episode_id for ep in eps]) for e, g, eps in groups]
        message = distributed.step_message(ids, batch)
        self.tell(message)
        distributed.broadcast_batch(self.shard, message, batch)

    def publish_state(self, policy) -> dict[str, torch.Tensor]:
        # gathered to rank 0; every rank takes part
        return distributed.full_state(policy.model, self.tied)

    def save(self, ckpt_dir: Path, model, opt, meta: dict) -> None:
        sharded_checkpoint.save(ckpt_dir, model, opt, meta | {"world_size": self.shard.size}, self.shard.main)

    def load(self, ckpt_dir: Path, model, opt) -> dict | None:
        _refuse_the_other_kind(ckpt_dir, self)
        state = sharded_checkpoint.load(ckpt_dir, model, opt)
        return state and state | {"optimizer_version": state["version"]}


def choose(cfg: Config) -> Alone | Ranks:
    """Ranks when this process was started by torchrun, else one process."""
    return Ranks(cfg) if distributed.launched() else Alone()


def _refuse_the_other_kind(ckpt_dir: Path, topology: Alone | Ranks) -> None:
    """A checkpoint written by the other kind of trainer cannot be restored: say so in one line."""
    single, sharded = (ckpt_dir / "checkpoint.pt").exists(), sharded_checkpoint.latest(ckpt_dir) is not None
    if isinstance(topology, Ranks):
        wrong, have = single and not sharded, "checkpoint.pt (one process)"
    else:
        wrong, have = sharded, "dcp/ (torchrun)"
    if wrong:
        raise RuntimeError(
            f"trainer: {ckpt_dir} holds a {have} checkpoint, which a trainer run as {topology.name} "
            f"cannot restore; restart it the way it was run"
        )
