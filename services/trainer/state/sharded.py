"""Snapshots under torchrun: ``torch.distributed.checkpoint`` (DCP), sharded (each rank writes its part).

    <run>/trainer/dcp/v000025/   model + optimizer (each rank's shards, DCP's .metadata), RNG, and
                                 meta.json: step, version, counters

Taken when a snapshot falls due (``snapshot_every_versions`` / ``snapshot_every_s`` / ``snapshot_replay_s``, and version
0 at the start), as
the single process takes its own (services/trainer/state/snapshot.py); the versions between are ledger lines only, and
a restore re-trains them, rank 0 sending each step to the other ranks as in training. DCP's save is a collective: every
rank copies its shards to CPU memory in the commit that takes the snapshot, and DCP's thread writes them
(``dcp.async_save``) while training goes on; a commit waits only when the next snapshot falls due before the previous
one landed.

Atomic as a single snapshot is: every rank writes into ``v000025.tmp/``; the save's future completes on rank 0 (the
coordinator) once every rank's files and the metadata are written; rank 0 then writes ``meta.json`` (fsynced),
renames the folder to ``v000025`` and fsyncs its parent, then removes older folders (``finish``: at the first commit
that finds the write done). A crash leaves the old folder or the new one complete; a ``.tmp`` folder is never read and
is removed by the next save.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shared.protocol.archive.jsonl import fsync_dir


def _dcp():
    """torch.distributed.checkpoint, imported on first use: only runs under torchrun need it, and its import costs
    every trainer process about a second of CPU at start."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict

    return dcp, state_dict


def folder(directory: Path) -> Path:
    return Path(directory) / "dcp"


def latest(directory: Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    done = sorted(
        p
        for p in folder(directory).glob("v*")
        if p.is_dir() and not p.name.endswith(".tmp") and (p / "meta.json").exists()
    )
    return done[-1] if done else None


@dataclass
class Writing:
    """A sharded snapshot on its way to disk: this rank's part is written by DCP's thread."""

    future: Future
    tmp: Path
    final: Path
    meta: dict
    started: float


def start(directory: Path, model, opt, meta: dict, main: bool, group) -> Writing:
    """Collective: every rank calls it. Each rank's shards are copied to CPU memory now (DCP's staging) and written
    by a background thread (``dcp.async_save``, its own collectives on ``group``: a gloo group of their own, so they
    never interleave with training's); ``finish`` makes the folder a snapshot once they land."""
    final = folder(directory) / f"v{meta['version']:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if main:
        # a crash's half-written folder of this version
        shutil.rmtree(tmp, ignore_errors=True)
    # before any rank writes into it
    dist.barrier()
    dcp, state_dict = _dcp()
    model_state, optim_state = state_dict.get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "rng": torch.get_rng_state()}
    future = dcp.async_save(state, checkpoint_id=tmp, process_group=group)
    return Writing(future, tmp, final, meta, time.monotonic())


def finish(writing: Writing, main: bool) -> Path:
    """This rank's part written (raises what the write raised); on rank 0 (``main``), whose write ends only once every
    rank's files and the metadata are on disk: ``meta.json`` (fsynced), the rename, the older folders removed."""
    writing.future.result()
    if main:
        tmp, final = writing.tmp, writing.final
        with open(tmp / "meta.json", "w") as fh:
            fh.write(json.dumps(writing.meta) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        # the same version again (a restart that re-trained it)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        for old in folder(final.parent.parent).glob("v*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return writing.final


def load(directory: Path, model, opt) -> dict | None:
    """Collective: restore model, optimizer and RNG from the newest checkpoint; its meta (None: no checkpoint)."""
    path = latest(directory)
    if path is None:
        return None
    dcp, state_dict = _dcp()
    model_state, optim_state = state_dict.get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "rng": torch.get_rng_state()}
    dcp.load(state, checkpoint_id=path)
    state_dict.set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"])
    return json.loads((path / "meta.json").read_text())
