"""The trainer's delta writer: beside each published version's file, a delta against the version before
(``shared/protocol/weights/delta.py``), made by one background thread, off the commit's critical path.

``submit(version, path, sha256)`` right after the version's file is written: the thread reads it and the version
before's file (still in the folder: the trainer prunes only versions no worker can need), encodes, and writes
``v<NNNNNN>.delta`` (atomic rename) unless the version has none (it is a snapshot: its file is the only way to it):
deltas off (``delta_max_chain`` 0), the first version, a base not on disk (after a restart that lost it), a new tensor
layout, or a delta larger than ``delta_max_fraction`` of the file. Every version's full file is published as before:
the snapshot a worker further behind than ``delta_max_chain`` downloads. A worker asking the weight server for a delta
still being written waits for it (``wait``, up to ``WAIT_S``); a missing delta is a 404 and the worker downloads the
file.

Each version gets a ``publish`` metrics record: full and delta bytes, elements changed, the entropy floor (the bits
naming the changed elements and their new values), encode seconds, snapshot and why.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.trainer.checkpoint import atomic_write
from shared.protocol.streams.metrics import record as record_metrics
from shared.protocol.weights import delta as weight_delta
from shared.runtime.weights.server import delta_name, file_name

# a request for a delta being written waits this long at most
WAIT_S = 30.0


def snapshot_reason(version: int, max_chain: int) -> str:
    """Why ``version`` has no delta by rule alone ('' when it gets one): deltas off, or the first version."""
    if max_chain <= 0:
        return "deltas off (delta_max_chain 0)"
    return "first version" if version <= 1 else ""


class DeltaWriter:
    def __init__(self, cfg, client, keys, folder: Path, log, serving: bool | None = None):
        """``serving``: the folder is served over HTTP (default: weights_port > 0); without a server no worker can
        fetch a delta (workers read the trainer's files), so none is made."""
        self.max_chain, self.max_fraction = cfg.delta_max_chain, cfg.delta_max_fraction
        self.serving = bool(cfg.weights_port) if serving is None else serving
        self.client, self.keys, self.folder, self.log = client, keys, Path(folder), log
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="delta-writer")
        self._lock = threading.Condition()
        # versions whose delta is being made
        self._busy: set[int] = set()
        # the entropy floor (a histogram of the changed bits: cheap beside the encode)
        self.measure_floor = True

    def submit(self, version: int, path: Path, sha256: str) -> None:
        """Make ``version``'s delta in the background (a snapshot version only gets its record)."""
        if not self.serving:
            return
        with self._lock:
            self._busy.add(version)
        self._pool.submit(self._run, version, Path(path), sha256)

    def wait(self, version: int, timeout: float = WAIT_S) -> None:
        """Until ``version``'s delta is written or judged a snapshot (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while version in self._busy and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)

    def resolve(self, name: str):
        """The weight server's lookup: a delta still being written is waited for; every name is in the folder (a
        link out of it is not served)."""
        if name.endswith(".delta"):
            try:
                self.wait(int(name[1:].split(".")[0]))
            except ValueError:
                pass
        path = self.folder / name
        try:
            inside = path.resolve().is_relative_to(self.folder.resolve())
        except OSError:
            inside = False
        return (path, None) if inside else None

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _run(self, version: int, path: Path, sha256: str) -> None:
        try:
            self._make(version, path, sha256)
        # a delta is an optimisation: the full file is published either way
        except Exception as exc:
            self.log.error("weights delta not written; workers download the file", version=version, error=str(exc))
        finally:
            with self._lock:
                self._busy.discard(version)
                self._lock.notify_all()

    def _make(self, version: int, path: Path, sha256: str) -> None:
        t0 = time.monotonic()
        target = path.read_bytes()
        rec = {"version": version, "full_bytes": len(target), "delta_bytes": 0, "snapshot": True, "reason": ""}
        base_path = self.folder / file_name(version - 1)
        rec["reason"] = snapshot_reason(version, self.max_chain) or (
            "" if base_path.is_file() else f"v{version - 1}'s file is not here"
        )
        if not rec["reason"]:
            base = base_path.read_bytes()
            try:
                delta = weight_delta.encode(base, target, version, version - 1, sha256=sha256)
            except weight_delta.DeltaError as exc:
                rec["reason"] = str(exc)
            else:
                header = weight_delta.read_header(delta)
                rec.update(
                    changed=header["changed"],
                    elements=(len(target) - header["data_start"]) // header["word"],
                    delta_bytes=len(delta),
                )
                if self.measure_floor:
                    rec["floor_bytes"] = round(weight_delta.entropy_floor_bits(base, target) / 8)
                if len(delta) > self.max_fraction * len(target):
                    rec["reason"] = f"delta {len(delta)} bytes > delta_max_fraction {self.max_fraction} of the file"
                else:
                    atomic_write(self.folder / delta_name(version), lambda tmp: Path(tmp).write_bytes(delta))
                    rec["snapshot"] = False
        rec["encode_s"] = round(time.monotonic() - t0, 4)
        record_metrics(self.client, self.keys, "publish", rec)
        self.log.info(
            "weights delta written" if not rec["snapshot"] else "version published as a snapshot",
            version=version,
            delta_bytes=rec["delta_bytes"],
            full_bytes=rec["full_bytes"],
            reason=rec["reason"] or None,
            seconds=rec["encode_s"],
        )
