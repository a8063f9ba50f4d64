"""The publisher: each committed version's weights leave the trainer as what changed, from one background thread.

The commit hands over the version's weights, already copied (``publish.frozen``: in the publish dtype, on the CPU), and
goes on training. The thread, per version, in commit order:

    serializes them as the version's safetensors bytes, in memory, and hashes them (the published sha256)
    writes ``v<N>.delta`` against the version before, whose bytes it kept (``shared/protocol/weights/delta.py``), or
      the full file ``v<N>.safetensors`` when the version has no delta: the first one after the trainer started (no
      bytes kept), every ``publish_full_every`` versions, deltas off (``delta_max_chain`` 0), a new tensor layout, or
      a delta larger than ``delta_max_fraction`` of the file
    publishes the version event; its path names ``v<N>.safetensors``, which whoever first needs it makes from the newest
      full file and the deltas since (``shared/runtime/weights/chain.py``): a rollout worker on this host, the weight
      server for a worker too far behind for deltas (``resolve``), an export
    records a ``publish`` metrics record (full and delta bytes, elements changed, the entropy floor, seconds, why a
      full file), prunes what no worker can need, and exports every ``export_every`` versions

At most ``QUEUE`` versions wait for the thread; a commit finding it full waits (counted). A failure in the thread is
the trainer's: the next hand-over raises it, the trainer restarts, and the restore publishes what was not.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from services.trainer import export, publish
from services.trainer.state.files import atomic_write
from shared.protocol.streams.metrics import record as record_metrics
from shared.protocol.weights import delta as weight_delta
from shared.runtime.faults import crash_point
from shared.runtime.weights import chain
from shared.runtime.weights.server import delta_name, file_name

# versions handed over and not yet published, at most
QUEUE = 2
# a request for a version still being written waits this long at most
WAIT_S = 30.0


def full_reason(version: int, max_chain: int, full_every: int, base_version: int | None) -> str:
    """Why ``version`` is published as a full file by rule alone ('' when it gets a delta)."""
    if max_chain <= 0:
        return "deltas off (delta_max_chain 0)"
    if base_version is None:
        return "first version since the trainer started"
    if base_version != version - 1:
        return f"the bytes kept are v{base_version}'s, not v{version - 1}'s"
    if full_every > 0 and version % full_every == 0:
        return f"every {full_every} versions (publish_full_every)"
    return ""


class Publisher:
    def __init__(self, cfg, client, keys, folder: Path, log):
        self.cfg, self.client, self.keys, self.folder, self.log = cfg, client, keys, Path(folder), log
        self.max_chain, self.max_fraction, self.full_every = (
            cfg.delta_max_chain,
            cfg.delta_max_fraction,
            cfg.publish_full_every,
        )
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publisher")
        self._queued: deque[Future] = deque()
        self._lock = threading.Condition()
        # versions handed over, not yet written
        self._busy: set[int] = set()
        # (version, bytes, sha256) of the last version written: the next one's delta base
        self._base: tuple[int, bytes, str] | None = None
        # (version, path, sha256, step) of the last version event sent (published again if Redis loses it)
        self.last: tuple[int, Path, str, int] | None = None
        # the entropy floor (a histogram of the changed bits: cheap beside the encode)
        self.measure_floor = True
        # seconds commits waited for a full queue, over the run
        self.waited_s = 0.0
        # copies of versions already serialized, for the next versions' copies to reuse
        self._spare: list[dict] = []

    # --- the trainer's side
    def submit(self, version: int, step: int, weights: dict) -> None:
        """Publish ``version`` (``weights``: a ``publish.frozen`` copy) in the background."""
        t0 = time.monotonic()
        while self._queued and (self._queued[0].done() or len(self._queued) >= QUEUE):
            # raises what the thread raised
            self._queued.popleft().result()
        self.waited_s += time.monotonic() - t0
        with self._lock:
            self._busy.add(version)
        self._queued.append(self._pool.submit(self._run, version, step, weights))

    def spare(self) -> dict | None:
        """A version's copy the thread is done with (``publish.frozen(..., into=)``), or None."""
        with self._lock:
            return self._spare.pop() if self._spare else None

    def adopt(self, version: int, data: bytes, digest: str) -> None:
        """A restore re-derived ``version`` with the published bytes: the next version's delta goes against them."""
        self.wait_idle()
        self._base = (version, data, digest)

    def forget(self) -> None:
        """No worker holds the bytes of the trainer's weights now (a version re-derived differently): the next
        version is a full file."""
        self.wait_idle()
        self._base = None

    def wait_idle(self) -> None:
        """Until every version handed over is published; raises what the thread raised."""
        while self._queued:
            self._queued.popleft().result()

    def close(self) -> None:
        try:
            self.wait_idle()
        finally:
            self._pool.shutdown(wait=True)

    # --- the weight server's lookup
    def wait(self, version: int, timeout: float = WAIT_S) -> None:
        """Until ``version`` is written (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while version in self._busy and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)

    def resolve(self, name: str):
        """A version being written is waited for; a full file not written is made from the chain (a worker too far
        behind for deltas); every name is in the folder (a link out of it is not served)."""
        try:
            version = int(name[1:].split(".")[0])
        except ValueError:
            return None
        self.wait(version)
        path = self.folder / name
        if name.endswith(".safetensors") and not path.is_file() and chain.can_make(self.folder, version):
            try:
                path = chain.make(self.folder, version)
            except (chain.ChainError, OSError) as exc:
                self.log.error("weights file could not be made from deltas", version=version, error=str(exc))
                return None
        try:
            inside = path.resolve().is_relative_to(self.folder.resolve())
        except OSError:
            inside = False
        return (path, None) if inside else None

    # --- the thread
    def _run(self, version: int, step: int, weights: dict) -> None:
        try:
            self._publish(version, step, weights)
        finally:
            with self._lock:
                self._busy.discard(version)
                self._lock.notify_all()

    def _publish(self, version: int, step: int, weights: dict) -> None:
        t0 = time.monotonic()
        data = publish.serialize(weights, version)
        with self._lock:
            # the copy is in ``data`` now: the next commits may copy into it (one per version that can be in flight)
            if len(self._spare) <= QUEUE:
                self._spare.append(weights)
        digest = hashlib.sha256(data).hexdigest()
        base = self._base
        rec = {"version": version, "full_bytes": len(data), "delta_bytes": 0, "snapshot": True}
        rec["reason"] = full_reason(version, self.max_chain, self.full_every, base and base[0])
        if not rec["reason"]:
            try:
                delta = weight_delta.encode(base[1], data, version, version - 1, base_sha256=base[2], sha256=digest)
            except weight_delta.DeltaError as exc:
                rec["reason"] = str(exc)
            else:
                header = weight_delta.read_header(delta)
                rec.update(
                    changed=header["changed"],
                    elements=(len(data) - header["data_start"]) // header["word"],
                    delta_bytes=len(delta),
                )
                if self.measure_floor:
                    rec["floor_bytes"] = round(weight_delta.entropy_floor_bits(base[1], data) / 8)
                if len(delta) > self.max_fraction * len(data):
                    rec["reason"] = f"delta {len(delta)} bytes > delta_max_fraction {self.max_fraction} of the file"
                else:
                    atomic_write(self.folder / delta_name(version), lambda tmp: Path(tmp).write_bytes(delta))
                    rec["snapshot"] = False
        path = self.folder / file_name(version)
        if rec["snapshot"]:
            atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))
        rec["written_bytes"] = rec["full_bytes"] if rec["snapshot"] else rec["delta_bytes"]
        self._base = (version, data, digest)
        publish.publish(self.client, self.keys, version, path, digest, step, self.cfg.weights_base_url)
        self.last = (version, path, digest, step)
        crash_point("trainer", "after_publish")
        rec["encode_s"] = round(time.monotonic() - t0, 4)
        record_metrics(self.client, self.keys, "publish", rec)
        self.log.info(
            "version published",
            version=version,
            sha256=digest[:12],
            delta_bytes=rec["delta_bytes"],
            full_bytes=rec["full_bytes"],
            full_file=rec["reason"] or None,
            seconds=rec["encode_s"],
        )
        # what no worker can need any more (a worker may be max_staleness + 2 versions behind)
        publish.prune(self.folder, keep_from=version - self.cfg.max_staleness - 2)
        export.maybe_export(self.cfg, version, self.log)

    def republish_last(self, latest: int) -> bool:
        """The last version event sent again when the stream (``latest``: its newest) lost it (a Redis restart that
        lost its last second); True when it was."""
        if self.last is None or latest >= self.last[0] or any(not f.done() for f in self._queued):
            return False
        version, path, digest, step = self.last
        publish.publish(self.client, self.keys, version, path, digest, step, self.cfg.weights_base_url)
        return True
