"""Snapshots of one trainer process's state: model, optimizer (AdamW's two moments: twice the model), RNG, step,
version and counters, every ``snapshot_every_versions`` versions or ``snapshot_every_s`` seconds, or once the training
since the last one took ``snapshot_replay_s`` seconds, whichever comes first, and at version 0 when a run starts
without one.

The last rule bounds a restart: it re-trains the steps since the newest snapshot, so their training time is what a
crash costs on top of starting the process. A snapshot costs the trainer its copy (the loop waits for it) and the
writer's CPU time (it runs beside training, on the same cores), so by that rule one falls due no more often than
``COST_RATIO`` times that cost: a large model's snapshots stay a small share of the time. The write's wait on the disk
(fsync) is not counted: it holds no core, and counting it put several times more versions between snapshots than
the rule asks for, each one re-trained at a restart.

    <run>/trainer/snapshots/v000025.pt

``take`` copies every tensor now (in memory: training goes on changing its own) and hands the copy to one background
thread, which writes it the atomic way (services/trainer/state/files.py) and then removes the older snapshots. A crash
leaves the snapshot before or the new one, never half of one. The training loop waits on the disk only when a snapshot
falls due before the previous one has landed. Nothing else is written per version: the ledger line is the commit, and
a restore re-trains the commits after the snapshot (services/trainer/state/replay.py).

A run folder from before snapshots (``checkpoint.pt``, ``optimizer.pt`` beside it) loads as a snapshot of its version.
Everything loads with ``weights_only``: tensors and plain data, no pickled code.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from services.trainer.state.files import atomic_write
from shared.runtime.faults import crash_point

FOLDER = "snapshots"
# the replay rule waits for at least this many times the last snapshot's cost (copy plus write) of training
COST_RATIO = 20


def file_of(directory: Path, version: int) -> Path:
    return Path(directory) / FOLDER / f"v{version:06d}.pt"


def newest(directory: Path) -> Path | None:
    """The newest complete snapshot file (a ``.tmp`` is a write a crash cut short), or None."""
    done = sorted(p for p in (Path(directory) / FOLDER).glob("v*.pt"))
    return done[-1] if done else None


def version_of(path: Path) -> int:
    return int(path.name[1:].split(".")[0])


class Snapshots:
    def __init__(
        self, directory: Path, every_versions: int, every_s: float, log, on_landed=None, replay_s: float = 0.0
    ):
        self.directory, self.every_versions, self.every_s, self.log = Path(directory), every_versions, every_s, log
        self.replay_s = replay_s
        # seconds of training since the newest snapshot (what a restart would re-train), and the last snapshot's cost
        self.trained_s, self.cost_s = 0.0, 0.0
        # called from the writer's thread with the landed snapshot's record
        self.on_landed = on_landed
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.last_version, self._last_at = -1, time.monotonic()
        # seconds the loop waited for an earlier snapshot to land, over the run
        self.waited_s = 0.0
        # the last snapshot's copy, reused by the next one (no fresh allocation, and its page faults, each time)
        self._buffers: dict | None = None

    def due(self, version: int) -> bool:
        if self.last_version < 0:
            return True
        by_versions = self.every_versions > 0 and version - self.last_version >= self.every_versions
        by_time = self.every_s > 0 and time.monotonic() - self._last_at >= self.every_s
        by_replay = self.replay_s > 0 and self.trained_s >= max(self.replay_s, COST_RATIO * self.cost_s)
        return by_versions or by_time or by_replay

    def trained(self, seconds: float) -> None:
        """A training step (or a restore's re-training) took ``seconds``: a restart now would re-train them too."""
        self.trained_s += seconds

    def wrote(self, seconds: float) -> None:
        """The snapshot just landed cost the trainer ``seconds`` (see the module's docstring)."""
        self.cost_s = seconds

    def restored(self, version: int) -> None:
        """The state just loaded (or just copied) is snapshot ``version``: the next is due from there."""
        self.last_version, self._last_at, self.trained_s = version, time.monotonic(), 0.0

    def take(self, version: int, step: int, model, opt, counts: dict) -> float:
        """Copy the state now, write it in the background; the seconds this took the caller (the copy, and any wait
        for the snapshot before)."""
        t0 = time.monotonic()
        self.wait()
        copied_from = time.monotonic()
        self.waited_s += copied_from - t0
        # into the previous snapshot's buffers (landed: nothing reads them), in CPU memory whatever the device
        self._buffers = copy_into({"model": model.state_dict(), "optimizer": opt.state_dict()}, self._buffers)
        state = {
            **self._buffers,
            "rng": torch.get_rng_state(),
            "step": step,
            "version": version,
            "counts": dict(counts),
        }
        self.restored(version)
        copy_s = time.monotonic() - copied_from
        self._pool = self._pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self._pending = self._pool.submit(self._write, version, state, copied_from, copy_s)
        return time.monotonic() - t0

    def _write(self, version: int, state: dict, t0: float, copy_s: float) -> None:
        """Runs on the writer's thread; ``t0``: when the copy began (the record's seconds: the copy and the write, the
        disk's wait included), ``copy_s``: the copy's time (with the write's CPU time, the record's cost)."""
        cpu0 = time.thread_time()
        path = file_of(self.directory, version)

        def write(tmp):
            torch.save(state, tmp)
            # tests only: killed with the file half-renamed into place, never
            crash_point("trainer", "snapshot_write")

        atomic_write(path, write)
        for old in path.parent.glob("v*.pt*"):
            if old != path and not old.name.endswith(".tmp"):
                old.unlink(missing_ok=True)
        record = {
            "version": version,
            "step": state["step"],
            "bytes": path.stat().st_size,
            "seconds": round(time.monotonic() - t0, 3),
            "cost_s": round(copy_s + time.thread_time() - cpu0, 4),
            "time": time.time(),
        }
        self.wrote(record["cost_s"])
        self.log.info("snapshot written", **record)
        if self.on_landed is not None:
            self.on_landed(record)

    def wait(self) -> None:
        """Until the snapshot being written (if any) is on disk; raises what its write raised."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def copy_into(src, buf=None):
    """A copy of ``src`` (dicts, lists and tensors, as state dicts are) training cannot change under the writer: each
    tensor copied into CPU memory, into ``buf``'s tensor at the same place when it fits (reused), else a new one;
    anything else deep-copied."""
    if torch.is_tensor(src):
        src = src.detach()
        if torch.is_tensor(buf) and buf.shape == src.shape and buf.dtype == src.dtype:
            return buf.copy_(src)
        out = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
        return out.copy_(src)
    if isinstance(src, dict):
        return {k: copy_into(v, buf.get(k) if isinstance(buf, dict) else None) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        old = buf if isinstance(buf, (list, tuple)) and len(buf) == len(src) else [None] * len(src)
        return type(src)(copy_into(v, b) for v, b in zip(src, old))
    return copy.deepcopy(src)


def load(directory: Path) -> dict | None:
    """The newest snapshot's state, or a pre-snapshot run's ``checkpoint.pt`` as one (its ``optimizer.pt`` when there is
    one); None: neither. ``optimizer`` may be None (a legacy checkpoint whose optimizer file never landed)."""
    path = newest(directory)
    if path is not None:
        return torch.load(path, map_location="cpu", weights_only=True)
    legacy = Path(directory) / "checkpoint.pt"
    if not legacy.exists():
        return None
    state = torch.load(legacy, map_location="cpu", weights_only=True)
    if "optimizer" not in state:
        opt_path = Path(directory) / "optimizer.pt"
        opt = torch.load(opt_path, map_location="cpu", weights_only=True) if opt_path.exists() else None
        state["optimizer"] = opt["optimizer"] if opt and opt["version"] == state["version"] else None
    return state
