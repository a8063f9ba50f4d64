"""Where a rollout worker's weights come from: the file a version event names, or a copy of it in a folder of the
worker's own, downloaded from the trainer's weight server (``weights_fetch``: auto | always | never).

A sync's ``fetch`` command starts ``prefetch`` in a thread, so the download and the sha256 check run while the worker
goes on generating; the thread acks the fetch once a verified copy is here. The ``load`` inside the pause then only
reads that copy (``local``): no download and no hashing in the pause. A load that no fetch preceded (by hand, or a
worker catching up at start) gets its copy right then. A version the trainer published as a delta, its folder readable
here, has its file made there from the chain (``shared/runtime/weights/chain.py``) by the first worker that needs it.

A download is first tried as deltas (``delta_max_chain`` > 0): from the newest verified copy here, at most that many
versions older, and the deltas since (``shared/runtime/weights/delta_fetch.py``), checked against the published
sha256; a bad chain is refused with one warning and the file downloaded instead."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from shared.protocol.weights.delta import DeltaError
from shared.runtime.config.keys import Config
from shared.runtime.folders import private_folder
from shared.runtime.weights import chain, delta_fetch
from shared.runtime.weights import fetch as weight_fetch
from shared.runtime.weights.checksum import sha256_file
from shared.runtime.weights.server import DELTA, file_name


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


class LocalWeights:
    def __init__(self, cfg: Config, log):
        self.mode, self.folder, self.keep, self.token = (
            cfg.weights_fetch,
            cfg.rollout_weights_path,
            cfg.rollout_weights_keep,
            cfg.weights_token,
        )
        # > 0: a download is a chain of at most this many deltas when one can be
        self.max_chain = cfg.delta_max_chain
        if self.mode != "never":
            # per user and run id, 0700
            private_folder(self.folder, "rollout_weights_dir", create=False)
        self.log = log
        # () -> the origins the token may go to (weight_origins.announced); set by the worker
        self.announced = None
        # which folder this worker downloads into, as the relay tree tells folders apart: host and path (workers on
        # one host with the same folder share each download: shared/protocol/weights/relay_tree.py); in every heartbeat
        self.folder_id = f"{socket.gethostname()}:{self.folder.absolute()}"
        self._lock = threading.Lock()
        # notified when a version's fetch ends (a relay waits on it)
        self._changed = threading.Condition(self._lock)
        # the newest version fetched, being fetched or loaded here (a relay waits for newer ones)
        self._newest = -1
        # version -> where its verified copy came from: trainer | relay | local
        self.sources: dict[int, str] = {}
        # version -> (verified file, sha256, its stat then)
        self._ready: dict[int, tuple[Path, str, tuple]] = {}
        # version -> why its last fetch failed (a load refuses with it)
        self._failed: dict[int, str] = {}
        self._running: dict[int, threading.Thread] = {}
        self.stats = {
            "fetched_bytes": 0,
            "fetches": 0,
            "fetch_failures": 0,
            "trainer_fetches": 0,
            "relay_fetches": 0,
            "relay_failures": 0,
            "relay_waits": 0,
            # versions made from deltas (docs/operations.md section 8): the delta bytes downloaded, the
            # full files' bytes they stood for, deltas applied, the longest chain, seconds fetching and
            # applying, chains refused (a bad delta: the file downloaded instead, one warning) and missing
            "delta_versions": 0,
            "delta_bytes": 0,
            "delta_full_bytes": 0,
            "delta_steps": 0,
            "delta_chain_max": 0,
            "delta_fetch_s": 0.0,
            "delta_apply_s": 0.0,
            "delta_fallbacks": 0,
            "delta_missing": 0,
        }

    def prefetch(self, version: int, path: str, sha256: str, url: str, done, relay: str = "") -> None:
        """Get a verified copy of ``version`` in a thread, then ``done(ok, error)`` (from that thread). ``relay``:
        another worker's URL of the file, tried first; ``url`` (the trainer's) when that fails."""
        self._start(version, path, sha256, url, done, relay)

    def served(self, name: str, wait_s: float = 0.0) -> tuple[Path, str] | None:
        """What this worker's relay serves under ``name`` (v<NNNNNN>.safetensors): its verified copy of that version,
        unchanged since it was verified, and the sha256 it matched; None when it holds none (or no digest).
        ``wait_s`` > 0 (sync_mode pull: a child asks as soon as the version is announced): a version this worker is
        fetching, or newer than any it has seen (announced, its fetch not started yet), is waited for, up to
        ``wait_s``, on the condition its fetch notifies when it ends; not polled."""
        # a delta this worker applied (kept beside the file it made): hashed when served
        if DELTA.fullmatch(name):
            path = self.folder / name
            return (path, None) if path.is_file() else None
        try:
            version = int(name[1:].split(".")[0])
        except ValueError:
            return None
        deadline = time.monotonic() + wait_s
        with self._changed:
            waited = False
            while True:
                ready = self._ready.get(version)
                if ready or version in self._failed:
                    break
                coming = version in self._running or version > self._newest
                left = deadline - time.monotonic()
                if not coming or left <= 0:
                    break
                if not waited:
                    waited = True
                    self.stats["relay_waits"] += 1
                self._changed.wait(left)
        return (ready[0], ready[1]) if ready and ready[1] and self._unchanged(ready) else None

    def local(self, version: int, path: str, sha256: str, url: str = "", waiting=lambda: None) -> Path:
        """The verified file to load ``version`` from: the copy a fetch made (waited for when it is still under
        way), or one made now (``waiting()`` is called about every second meanwhile: the heartbeat). The error of a
        failed fetch is raised once (a later load tries again)."""
        with self._lock:
            ready, running, failed = self._ready.get(version), self._running.get(version), version in self._failed
        if running is None and not failed and not (ready and ready[1] == sha256 and self._unchanged(ready)):
            running = self._start(version, path, sha256, url, None)
        while running is not None and running.is_alive():
            running.join(1.0)
            waiting()
        with self._lock:
            error = self._failed.pop(version, None)
            ready = self._ready.get(version)
        if error is not None:
            raise ValueError(error)
        if not ready or ready[1] != sha256:
            raise ValueError(f"weights v{version}: no verified copy here (sha256 {sha256[:12]}...)")
        return ready[0]

    def _start(self, version: int, path: str, sha256: str, url: str, done, relay: str = "") -> threading.Thread:
        def work() -> None:
            # the same version asked for again (a repeated sync): after the first, cheap
            if earlier is not None:
                earlier.join()
            try:
                self._get(version, path, sha256, url, relay)
            # any failure is an error ack: the syncer must hear from this worker
            except Exception as exc:
                error = str(exc) or type(exc).__name__
                with self._lock:
                    self._failed[version] = error
                    self.stats["fetch_failures"] += 1
                self.log.error("weights fetch failed; keeping old version", version=version, url=url, error=error)
                ok = False
            else:
                error, ok = "", True
            with self._changed:
                if self._running.get(version) is threading.current_thread():
                    del self._running[version]
                self._changed.notify_all()
            if done is not None:
                done(ok, error)

        thread = threading.Thread(target=work, daemon=True, name=f"fetch-v{version}")
        with self._lock:
            earlier = self._running.get(version)
            self._failed.pop(version, None)
            self._running[version] = thread
            self._newest = max(self._newest, version)
        thread.start()
        return thread

    @staticmethod
    def _unchanged(ready: tuple) -> bool:
        try:
            # the file verified then, unchanged since
            return _stat_key(ready[0]) == ready[2]
        except OSError:
            return False

    def loaded(self, version: int) -> None:
        """``version`` is in the engine: downloads older than the newest few are deleted."""
        with self._lock:
            self._ready = {v: r for v, r in self._ready.items() if v >= version}
            self._newest = max(self._newest, version)
            self.sources = {v: src for v, src in self.sources.items() if v >= version}
        if self.folder.is_dir():
            for v in weight_fetch.prune(self.folder, self.keep, version):
                self.log.debug("deleted old downloaded weights", version=v)

    # --- one version's file
    def _get(self, version: int, path: str, sha256: str, url: str, relay: str = "") -> Path:
        with self._lock:
            ready = self._ready.get(version)
        # verified before (a sync repeated)
        if ready and ready[1] == sha256 and self._unchanged(ready):
            return ready[0]
        published = Path(path)
        # a version the trainer published as a delta, its folder on this host: the file made from the chain there
        if self.mode != "always" and not published.is_file() and chain.can_make(published.parent, version):
            try:
                chain.make(published.parent, version, sha256)
            except (chain.ChainError, OSError) as exc:
                # nowhere else to get it from: this is why the version cannot be loaded
                if self.mode == "never" or not (url or relay):
                    raise ValueError(str(exc)) from None
                self.log.warning("weights file could not be made from the deltas here", version=version, error=str(exc))
        # why the published file, readable here, is not the published version
        unusable = None
        if self.mode != "always" and published.is_file() and os.access(published, os.R_OK):
            try:
                return self._verified(version, published, sha256)
            except ValueError as exc:
                if self.mode == "never" or not url:
                    raise
                unusable = exc
                self.log.warning(
                    "published weights file unusable here; downloading it", version=version, error=str(exc)
                )
        elif self.mode == "never":
            raise ValueError(f"weights v{version}: {path} is not readable on this host (weights_fetch = never)")
        elif not url and not relay:
            raise ValueError(
                f"weights v{version}: {path} is not readable on this host and the version event has no "
                f"url to download it from (the trainer serves weights only with weights_port > 0)"
            )
        try:
            got = self._download(version, sha256, url, relay)
        except weight_fetch.FetchError as exc:
            if unusable is None:
                raise
            raise ValueError(f"{unusable}; the download instead failed too: {exc}") from None
        with self._lock:
            self._ready[version] = (got.path, sha256, _stat_key(got.path))
            self.stats["fetches"] += 1
            self.stats["fetched_bytes"] += got.downloaded
            self.stats["relay_fetches" if got.relayed else "trainer_fetches"] += 1
            self.sources[version] = "relay" if got.relayed else "trainer"
        self.log.info(
            "weights fetched",
            version=version,
            url=relay if got.relayed else url,
            mb=round(got.bytes / 1e6, 1),
            downloaded_mb=round(got.downloaded / 1e6, 1),
            resumed_from=got.resumed_from,
            seconds=round(got.seconds, 3),
        )
        return got.path

    def _download(self, version: int, sha256: str, url: str, relay: str) -> weight_fetch.Fetched:
        """From ``relay`` when given (another worker), else, or when that fails, from ``url`` (the trainer); a cut
        relay transfer's part file is resumed from the trainer (If-Range on the same sha256)."""
        trusted = self.announced() if self.announced is not None else None
        chained = self._from_deltas(version, sha256, url, relay, trusted)
        if chained is not None:
            return chained
        if relay:
            try:
                return weight_fetch.fetch(
                    relay, version, sha256, self.folder, self.token, log=self.log, relayed=True, trusted=trusted
                )
            except weight_fetch.FetchError as exc:
                with self._lock:
                    self.stats["relay_failures"] += 1
                if not url:
                    raise
                self.log.warning(
                    "relay fetch failed; fetching from the trainer", version=version, relay=relay, error=str(exc)
                )
        return weight_fetch.fetch(url, version, sha256, self.folder, self.token, log=self.log, trusted=trusted)

    def _base(self, version: int) -> tuple[int, Path, str] | None:
        """The newest verified copy older than ``version``: one this process verified, else a file left in the folder
        by an earlier process (a worker killed mid-chain), hashed now (a delta names its base's sha256)."""
        with self._lock:
            ready = sorted((v, r) for v, r in self._ready.items() if v < version and r[1])
        for v, r in reversed(ready):
            if self._unchanged(r):
                return v, r[0], r[1]
        older = [v for v in weight_fetch.kept_versions(self.folder) if v < version] if self.folder.is_dir() else []
        if older:
            path = self.folder / file_name(older[-1])
            return older[-1], path, sha256_file(path)
        return None

    def _from_deltas(self, version: int, sha256: str, url: str, relay: str, trusted) -> weight_fetch.Fetched | None:
        """``version`` made from this worker's newest verified copy and the deltas since (from the relay, else the
        trainer), checked against ``sha256``; None when no chain can be had (no base, more than ``delta_max_chain``
        versions behind, a delta missing or bad: then the file is downloaded; a bad one is warned about once)."""
        base = self._base(version) if self.max_chain > 0 and sha256 else None
        if base is None or version - base[0] > self.max_chain:
            # nothing to start from, or too far behind: the file itself (the snapshot)
            return None
        t0 = time.monotonic()
        for source in [s for s in (relay, url) if s]:
            try:
                got = delta_fetch.chain(
                    source,
                    *base,
                    version,
                    sha256,
                    self.folder,
                    self.token,
                    trusted=trusted,
                    max_bytes=base[1].stat().st_size,
                )
            except delta_fetch.DeltaMissing as exc:
                self.log.debug("no weights delta; trying the next source or the file", version=version, error=str(exc))
                with self._lock:
                    self.stats["delta_missing"] += 1
                continue
            except (DeltaError, weight_fetch.FetchError, OSError) as exc:
                with self._lock:
                    self.stats["delta_fallbacks"] += 1
                self.log.warning(
                    "weights delta chain refused; downloading the full file",
                    version=version,
                    base=base[0],
                    source=source,
                    error=str(exc),
                )
                return None
            with self._lock:
                st = self.stats
                st["delta_versions"] += 1
                st["delta_bytes"] += got.downloaded
                st["delta_full_bytes"] += got.bytes
                st["delta_steps"] += got.steps
                st["delta_chain_max"] = max(st["delta_chain_max"], got.steps)
                st["delta_fetch_s"] += got.fetch_s
                st["delta_apply_s"] += got.apply_s
            self.log.info(
                "weights made from deltas",
                version=version,
                base=base[0],
                steps=got.steps,
                delta_kb=round(got.downloaded / 1e3, 1),
                full_mb=round(got.bytes / 1e6, 1),
                fetch_s=round(got.fetch_s, 3),
                apply_s=round(got.apply_s, 3),
            )
            return weight_fetch.Fetched(
                got.path, got.bytes, got.downloaded, 0, got.steps, time.monotonic() - t0, relayed=source == relay
            )
        return None

    def _verified(self, version: int, path: Path, sha256: str) -> Path:
        key = _stat_key(path)
        # an event without one (hand-written) is taken as it is
        if sha256:
            actual = sha256_file(path)
            if actual != sha256:
                raise ValueError(
                    f"weights {path}: sha256 {actual[:12]}... does not match the published "
                    f"{sha256[:12]}... (corrupt or truncated file)"
                )
        with self._lock:
            self._ready[version] = (path, sha256, key)
            self.sources[version] = "local"
        return path
