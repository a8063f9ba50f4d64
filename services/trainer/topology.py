"""How the trainer is laid out, chosen once at start: one process (``Alone``), or data-parallel ranks under torchrun
(``Ranks``: FSDP2, rank 0 reads samples and tells the other ranks each step; services/trainer/distributed.py).

The training loop calls the same methods on either and never asks which it runs: binding the process (log context,
device), preparing the model, telling the other ranks a command, sharing a step's batch, gathering the weights a
version publishes, and taking and loading a snapshot (services/trainer/state/).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from services.trainer import distributed
from services.trainer.batch import Batch
from services.trainer.state import sharded, snapshot
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config


class Alone:
    """One trainer process: the whole model, snapshots copied in memory and written in the background, no ranks to
    tell anything."""

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

    def snapshot(self, snaps: snapshot.Snapshots, model, opt, meta: dict) -> float:
        return snaps.take(meta["version"], meta["step"], model, opt, meta["counts"])

    def land(self, snaps: snapshot.Snapshots, wait: bool = False) -> None:
        # the snapshot's own thread lands it
        if wait:
            snaps.wait()

    def load(self, ckpt_dir: Path, model, opt) -> dict | None:
        _refuse_the_other_kind(ckpt_dir, self)
        state = snapshot.load(ckpt_dir)
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
        # the sharded snapshot being written, and the process group its collectives use
        self._writing: sharded.Writing | None = None
        self._group = None
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

    def snapshot(self, snaps: snapshot.Snapshots, model, opt, meta: dict) -> float:
        # every rank, in the same commit (rank 0 said so): the shards copied now, written by DCP's thread
        t0 = time.monotonic()
        self.land(snaps, wait=True)
        if self._group is None:
            # the snapshots' own collectives, never interleaved with training's on the default group
            self._group = dist.new_group(backend="gloo")
        meta = meta | {"world_size": self.shard.size}
        self._writing = sharded.start(snaps.directory, model, opt, meta, self.shard.main, self._group)
        snaps.restored(meta["version"])
        return time.monotonic() - t0

    def land(self, snaps: snapshot.Snapshots, wait: bool = False) -> None:
        """The snapshot being written made the newest one once it is on disk (``wait``: until it is)."""
        writing = self._writing
        if writing is None or not (wait or writing.future.done()):
            return
        self._writing = None
        path = sharded.finish(writing, self.shard.main)
        if self.shard.main and snaps.on_landed is not None:
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            record = {
                "version": writing.meta["version"],
                "step": writing.meta["step"],
                "bytes": size,
                "seconds": round(time.monotonic() - writing.started, 3),
                "time": time.time(),
            }
            snaps.log.info("snapshot written", **record)
            snaps.on_landed(record)
        # DCP's writer threads' CPU time is not measurable from here: the wall time, the disk's wait included, stands
        # for it (an upper bound: sharded snapshots fall due no more often than the rule asks)
        snaps.wrote(time.monotonic() - writing.started)

    def load(self, ckpt_dir: Path, model, opt) -> dict | None:
        _refuse_the_other_kind(ckpt_dir, self)
        return sharded.load(ckpt_dir, model, opt)


def choose(cfg: Config) -> Alone | Ranks:
    """Ranks when this process was started by torchrun, else one process."""
    return Ranks(cfg) if distributed.launched() else Alone()


def _refuse_the_other_kind(ckpt_dir: Path, topology: Alone | Ranks) -> None:
    """A snapshot written by the other kind of trainer cannot be restored: say so in one line."""
    single = snapshot.newest(ckpt_dir) is not None or (ckpt_dir / "checkpoint.pt").exists()
    shards = sharded.latest(ckpt_dir) is not None
    if isinstance(topology, Ranks):
        wrong, have = single and not shards, "snapshots/ (one process)"
    else:
        wrong, have = shards, "dcp/ (torchrun)"
    if wrong:
        raise RuntimeError(
            f"trainer: {ckpt_dir} holds a {have} snapshot, which a trainer run as {topology.name} "
            f"cannot restore; restart it the way it was run"
        )
