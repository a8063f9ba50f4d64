"""A rollout worker in ``sync_mode = pull``: it takes each announced version when it decides to, with no command.

- Announce: it also wakes on the ``versions`` stream. A version newer than the one it runs and than the one it is
  fetching starts a background download (``LocalWeights.prefetch``: a thread, resumable, sha256-checked) while it
  goes on generating, from its parent in the relay tree (``shared/protocol/weights/relay_tree.py``, the syncer's rolling
  rule, over the live workers) or from the trainer when it hangs under the root or relays are off; a failing relay
  falls back to the trainer. A verified download appends ``fetched`` to the ``pulls`` stream (that wakes it when
  idle, and is the record of where each copy came from).
- Load at a cheap point: between engine steps, ``load_policy.decide`` says whether to load the downloaded version
  now (gated, idle, quiet, overdue). Then it asks for the load lease (``shared/protocol/streams/pulls.py``: at most
  ``max_loading`` workers loading at once, expiring after ``load_lease_s``); refused, it asks again when a
  release wakes it (the ``pulls`` stream) or when the first lease held expires. With the lease: the worker's own
  pause, load, resume (episodes abort and continue by replay; every token keeps its version), its heartbeat
  carries the new version, then the lease goes back.

``stats`` (in the worker's metrics records): versions pulled (loaded), from the trainer / a relay / the trainer's
own file read here (``weights_fetch`` auto on the trainer's host: nothing downloaded), seconds from
the announcement (the version's publish time) to loaded (sum and max), seconds paused for loads.
"""

from __future__ import annotations

import time

from services.rollout.weights import load_policy
from shared.protocol.episode.errors import EventError
from shared.protocol.streams import pulls, versions
from shared.protocol.weights import relay_tree
from shared.runtime import heartbeat
from shared.runtime.faults import crash_point
from shared.runtime.weights.server import PREFIX, file_name

# a relay asked for a version it is still fetching waits this long at most (and fetch_timeout)
RELAY_WAIT_S = 30.0


class Puller:
    def __init__(self, cfg, client, keys, worker_id: str, weights, log):
        self.cfg, self.client, self.keys, self.worker_id, self.weights = cfg, client, keys, worker_id, weights
        self.log = log
        self.cursor = self.pulls_cursor = "0-0"
        # the newest announced version newer than the engine's
        self.target: versions.Version | None = None
        # time.time() when the target was seen (its publish time is used when it has one)
        self.seen_at = 0.0
        # version -> (ok, error) once its download ended
        self.done: dict[int, tuple[bool, str]] = {}
        # time.monotonic(): a refused lease is asked for again then, or on a release
        self._lease_retry = 0.0
        self._lease_wanted = True
        # the gate is complete for a newer version than the engine's (load_policy: behind)
        self.behind = False
        self.stats = {
            "pulled": 0,
            "pulled_from_trainer": 0,
            "pulled_from_relay": 0,
            "pulled_local": 0,
            "pull_announced_s": 0.0,
            "pull_announced_max_s": 0.0,
            "pull_paused_s": 0.0,
            "pull_lease_refused": 0,
        }

    def relay_wait_s(self) -> float:
        """How long this worker's relay waits for a copy it is fetching (a child may ask before the copy is here)."""
        return min(RELAY_WAIT_S, self.cfg.fetch_timeout)

    def start(self) -> None:
        """From here on every announced version wakes it (before the worker's catch-up: none is missed)."""
        last = self.client.xrevrange(self.keys.versions, count=1)
        self.cursor = last[0][0].decode() if last else "0-0"
        self.pulls_cursor = pulls.last_id(self.client, self.keys)

    def wake_streams(self) -> dict:
        return {self.keys.versions: self.cursor, self.keys.pulls: self.pulls_cursor}

    def next_due(self) -> float | None:
        """When a refused lease is worth asking again (an idle worker's wait ends then at the latest)."""
        waiting = self.target is not None and self.target.version in self.done and not self._lease_wanted
        return self._lease_retry if waiting else None

    def saw(self, name: str, entries, engine_version: int) -> bool:
        """Entries of the versions or pulls stream (True: they were this module's)."""
        if name == self.keys.pulls:
            self.pulls_cursor = entries[-1][0].decode()
            if any(p.event in ("released", "expired") for p in pulls.decode_entries(entries)):
                # a lease came free
                self._lease_wanted = True
            return True
        if name != self.keys.versions:
            return False
        self.cursor = entries[-1][0].decode()
        try:
            # only the newest matters
            newest = versions.decode(*entries[-1])
        except EventError as exc:
            self.log.error("versions entry unreadable; skipped", error=str(exc))
            return True
        self.announce(newest, engine_version)
        return True

    def announce(self, v: versions.Version, engine_version: int) -> None:
        if v.version <= max(engine_version, self.target.version if self.target else -1):
            return
        self.target, self.seen_at = v, time.time()
        relay = self._parent_url(v.version)
        t0 = time.monotonic()

        # in the fetch thread
        def done(ok: bool, error: str) -> None:
            self.done[v.version] = (ok, error)
            # the record of the source, and the wake-up of this worker when it idles
            if ok:
                pulls.fetched(
                    self.client,
                    self.keys,
                    self.worker_id,
                    v.version,
                    self.weights.sources.get(v.version, "trainer"),
                    time.monotonic() - t0,
                )

        self.log.info("version announced; fetching it while generating", version=v.version, relay=relay or None)
        self.weights.prefetch(v.version, v.path, v.sha256, v.url, done, relay=relay)

    def complete(self, complete: int | None, engine_version: int) -> None:
        """The gate's complete version, read before a claim: newer than the engine's, this worker was counted out
        (its heartbeat lapsed) while every other one moved on; it fetches the newest version if it is not already."""
        self.behind = complete is not None and complete > engine_version
        if self.behind and (self.target is None or self.target.version < complete):
            latest = versions.latest(self.client, self.keys)
            if latest is not None:
                self.announce(latest, engine_version)

    def _parent_url(self, version: int) -> str:
        """This worker's relay parent's URL of ``version``, "" for the trainer (the root level, or no relays)."""
        live = heartbeat.alive_of(self.client, self.keys, "rollout")
        relays = {w: info["relay"] for w, info in live.items() if info.get("relay")}
        folders = {**{w: info.get("fetch_dir", "") for w, info in live.items()}, self.worker_id: self.weights.folder_id}
        parent = relay_tree.parents(set(live) | {self.worker_id}, relays, self.cfg.relay_fanout, folders).get(
            self.worker_id
        )
        return f"{relays[parent].rstrip('/')}{PREFIX}{file_name(version)}" if parent else ""

    def tick(self, engine_version: int, busy_slots: float, gated: bool, load) -> None:
        """Between engine steps: load the downloaded target now when the policy says so and the lease is had.
        ``load(version)`` is the worker's pause, load, resume (and heartbeat)."""
        v = self.target
        if v is None:
            return
        if v.version <= engine_version:
            self.target = None
            self.done = {n: d for n, d in self.done.items() if n > engine_version}
            return
        if v.version not in self.done:
            # still downloading
            return
        ok, error = self.done[v.version]
        # logged by the fetch; the next announcement tries again
        if not ok:
            self.target = None
            return
        announced = v.time or self.seen_at
        state = load_policy.State(
            gated=gated,
            busy_slots=busy_slots,
            slots=self.cfg.max_groups_in_flight,
            waited_s=max(0.0, time.time() - announced),
            behind=self.behind,
        )
        reason = load_policy.decide(state, self.cfg.pull_load_below, self.cfg.pull_max_wait_s)
        now = time.monotonic()
        if reason is None or not (self._lease_wanted or now >= self._lease_retry):
            return
        lease = pulls.acquire(
            self.client,
            self.keys,
            self.worker_id,
            v.version,
            self.cfg.max_loading,
            self.cfg.load_lease_s,
            reason=reason,
        )
        if not lease.granted:
            self.stats["pull_lease_refused"] += 1
            self._lease_wanted, self._lease_retry = False, now + max(0.05, lease.retry_s)
            return
        # tests only (shared/runtime/faults.py)
        crash_point("rollout", "pull_leased")
        t0 = time.monotonic()
        try:
            load(v)
        except (OSError, ValueError, RuntimeError) as exc:
            self.log.error("pulled weights refused; keeping old version", version=v.version, error=str(exc))
            self.target = None
            pulls.release(self.client, self.keys, self.worker_id, v.version, error=str(exc)[:200])
            return
        paused = time.monotonic() - t0
        since = max(0.0, time.time() - announced)
        source = self.weights.sources.get(v.version, "trainer")
        self.stats["pulled"] += 1
        # local: the trainer's file
        self.stats["pulled_local" if source == "local" else f"pulled_from_{source}"] += 1
        self.stats["pull_announced_s"] += since
        self.stats["pull_announced_max_s"] = max(self.stats["pull_announced_max_s"], since)
        self.stats["pull_paused_s"] += paused
        pulls.release(
            self.client,
            self.keys,
            self.worker_id,
            v.version,
            source=source,
            reason=reason,
            announced_s=f"{since:.3f}",
            paused_s=f"{paused:.3f}",
        )
        self.target, self._lease_wanted, self.behind = None, True, False
        self.done = {n: d for n, d in self.done.items() if n > v.version}
        self.log.info(
            "pulled version loaded",
            version=v.version,
            reason=reason,
            source=source,
            announced_s=round(since, 3),
            paused_s=round(paused, 3),
        )
