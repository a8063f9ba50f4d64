"""The syncer: moves each published version to the rollout workers and holds
the staleness gate.

For every new version event: have every live rollout worker fetch the version's
file (a download into its own folder when it cannot read the trainer's, else a
sha256 check; either way while it goes on generating) and wait until each holds
a verified copy (up to ``fetch_timeout``), then pause them, wait for each ack
(a worker whose heartbeat lapses, whose process on this host is gone, or that stays
silent past ``sync_timeout``, is logged and not waited on), tell them to load their copy, wait, open the gate for
it, resume them, wait. So the pause is never lengthened by a download. Each
phase's duration goes to the metrics stream (``paused_s``: pause + load +
resume, what generation lost). Only generation pauses: rq tool jobs keep running
in their own processes.

The gate is a hash ``gate`` {version, limit, per_version, complete}: how many prompt groups may
have started in total under the current version (AReaL's admission control,
``shared.protocol.staleness.group_capacity``); rollout workers reserve starts against it, a worker on an
older version under its own version's limit. With ``sync_mode=rolling`` the pause, load and resume go to
waves of at most ``max_loading`` workers; the gate opens after the first wave and is marked complete after
the last. With ``sync_mode=pull`` the syncer sends no command at all (``announce.py``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import redis

from services.syncer.announce import Announcer
from shared.protocol import gate
from shared.protocol.keys import Keys
from shared.protocol.staleness import group_capacity
from shared.protocol.streams import control, metrics, versions
from shared.protocol.weights import relay_tree
from shared.runtime import heartbeat, runstate
from shared.runtime.config.keys import Config
from shared.runtime.faults import crash_point
from shared.runtime.weights.server import PREFIX, file_name


@dataclass
class _Round:
    """One sync's state: what it moves, to whom, and what it has seen so far."""

    sync: str
    version: int
    path: str
    sha256: str
    url: str
    # live when it began
    workers: set[str]
    log: object
    # died or stayed silent: not waited for again
    missing: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    # per command, summed over waves and levels
    durations: dict[str, float] = field(default_factory=dict)
    # worker -> the relay URL its fetch named
    relayed: dict[str, str] = field(default_factory=dict)
    fetch_levels: int = 1
    # the longest wave: pause sent to resume acked
    longest_paused: float = 0.0
    # the smallest fraction of the workers not in the wave being changed
    generating_min: float = 1.0


def groups_per_version(cfg: Config) -> int:
    return cfg.batch_groups * cfg.steps_per_version


class Syncer:
    # the phases of a sync, in order; bench/weights/fetch_pause.py drops "fetch" to measure a download inside the pause
    phases = ("fetch", "pause", "load", "resume")

    def __init__(self, cfg: Config, client: redis.Redis, log, heartbeat=lambda: None):
        self.cfg, self.client, self.log = cfg, client, log
        # refreshes this process's alive key; called often, also while waiting
        self.heartbeat = heartbeat
        self._next_beat = 0.0
        self.keys = Keys(cfg.run)
        self.version = 0
        self.cursor = "0-0"
        # workers seen paused between syncs
        self._next_stuck_check, self._stuck = 0.0, set()

    @property
    def rolling(self) -> bool:
        """sync_mode rolling; mode=sync keeps the global pause (nothing starts before every worker has the version)."""
        return self.cfg.sync_mode == "rolling" and self.cfg.mode != "sync"

    def live_workers(self) -> dict[str, dict]:
        # the rollout registry (no SCAN of the keyspace, which holds one stream per episode), less the workers of this
        # host whose process is gone while their key lives on
        found = heartbeat.alive_of(self.client, self.keys, "rollout")
        return {w: fields for w, fields in found.items() if not heartbeat.gone(w)}

    def set_gate(self, version: int, complete: bool = True) -> None:
        limit = group_capacity(version, self.cfg.max_staleness, groups_per_version(self.cfg), started_groups=0)
        gate.open(
            self.client,
            self.keys,
            version,
            limit,
            self.cfg.max_staleness,
            groups_per_version(self.cfg),
            complete=complete,
        )

    def start(self) -> None:
        last = versions.latest(self.client, self.keys)
        if last:
            self.cursor, self.version = last.entry_id, last.version
            # restarted mid-sync (workers left paused, or not at the newest version), or workers missed a round
            behind = [
                w
                for w, info in self.live_workers().items()
                if int(info.get("version", -1)) < self.version or info.get("paused") == "1"
            ]
            if behind:
                self.sync(last.version, last.path, last.sha256, last.url)
        self.set_gate(self.version)

    @property
    def pull(self) -> bool:
        """sync_mode pull: workers fetch and load announced versions themselves (services/syncer/announce.py)."""
        return self.cfg.sync_mode == "pull" and self.cfg.mode != "sync"

    def run(self, should_stop=lambda: False) -> None:
        if self.pull:
            return Announcer(self).run(should_stop)
        self.start()
        self.log.info("ready", version=self.version)
        while not should_stop():
            self._beat()
            entries = versions.read_after(self.client, self.keys, self.cursor, block_ms=200)
            if not entries:
                self._resume_if_stuck()
                continue
            self.cursor = entries[-1].entry_id
            # only the newest matters
            newest = entries[-1]
            if newest.version > self.version:
                self.sync(newest.version, newest.path, newest.sha256, newest.url)

    def _resume_if_stuck(self) -> None:
        """Between syncs no worker should be paused. One that is, seen twice 2 s apart, lost a command of a
        sync (a Redis restart that lost its last second): it gets the newest version's sync again. The gate
        lost with such a restart is set again too."""
        now = time.monotonic()
        if now < self._next_stuck_check:
            return
        self._next_stuck_check = now + 2.0
        gate_version = gate.opened_version(self.client, self.keys)
        # a Redis restart lost the gate's update
        if gate_version != self.version:
            self.log.warning(
                "staleness gate behind the synced version; set again", gate=gate_version, version=self.version
            )
            self.set_gate(self.version)
        stuck = {w for w, info in self.live_workers().items() if info.get("paused") == "1"}
        latest = versions.latest(self.client, self.keys)
        if stuck & self._stuck and latest:
            self.log.warning("workers paused with no sync under way; syncing again", workers=sorted(stuck))
            self.sync(latest.version, latest.path, latest.sha256, latest.url)
            stuck = set()
        self._stuck = stuck

    def sync(self, version: int, path: str, sha256: str, url: str = "") -> dict:
        sync_id = f"v{version}-{uuid.uuid4().hex[:6]}"
        live = self.live_workers()
        r = _Round(sync_id, version, path, sha256, url, set(live), self.log.bind(version=version, sync=sync_id))
        t_start = time.monotonic()
        if "fetch" in self.phases:
            self._fetch(r, live)
        waves = self._waves(r)
        for i, wave in enumerate(waves):
            t_wave = time.monotonic()
            targets = tuple(wave) if self.rolling else ()
            for cmd in ("pause", "load", "resume"):
                if cmd not in self.phases:
                    continue
                if cmd == "resume" and i == (0 if self.rolling else len(waves) - 1):
                    # open the gate first: the resume wakes the workers, who then claim at once. Rolling: after
                    # the first wave; the workers still on the old version reserve under their own version's
                    # limit (shared/protocol/gate.py), so no group starts on an older version under the new one
                    self.set_gate(version, complete=not self.rolling or len(waves) == 1)
                self._phase(r, cmd, set(wave), targets, part=str(i) if targets else "")
            r.longest_paused = max(r.longest_paused, time.monotonic() - t_wave)
            r.generating_min = min(r.generating_min, 1 - len(wave) / max(1, len(r.workers)))
        if not waves:
            self.set_gate(version)
        elif self.rolling and len(waves) > 1:
            # every live worker runs it now
            gate.mark_complete(self.client, self.keys, version)
        self.version = version
        paused_s = sum(r.durations.get(f"{c}_s", 0.0) for c in ("pause", "load", "resume"))
        record = {
            "version": version,
            "sync": sync_id,
            "workers": len(r.workers),
            "missing": sorted(r.missing),
            "missing_why": r.why,
            "refused": r.refused,
            "total_s": time.monotonic() - t_start,
            "paused_s": paused_s,
            "sync_mode": "rolling" if self.rolling else "global",
            "waves": len(waves),
            "max_paused_s": r.longest_paused,
            "generating_min": r.generating_min,
            "fetch_levels": r.fetch_levels,
            "relayed": r.relayed,
            **r.durations,
        }
        metrics.record(self.client, self.keys, "sync", record)
        r.log.info(
            "synced",
            workers=len(r.workers),
            missing=len(r.missing),
            refused=len(r.refused),
            waves=len(waves),
            relayed=len(r.relayed),
            **{k: round(v, 4) for k, v in r.durations.items()},
        )
        return record

    def _waves(self, r: "_Round") -> list[list[str]]:
        """Global: one wave, every worker (the commands name no one, so a worker silent now obeys them later).
        Rolling: the workers that hold the version, ``max_loading`` at a time."""
        if not self.rolling:
            return [sorted(r.workers)]
        ready = sorted(r.workers - r.missing)
        n = self.cfg.max_loading
        return [ready[i : i + n] for i in range(0, len(ready), n)]

    def _fetch(self, r: "_Round", live: dict[str, dict]) -> None:
        """Every worker gets a verified copy while it generates. With workers that relay (``relay`` in their
        heartbeat), the fetch goes out level by level of a tree of fan-out ``relay_fanout`` rooted at the trainer:
        the first k relaying workers download from the trainer, the next k² from those (once they acked), and so
        on; a worker whose parent did not ack, and every fetch that fails from its relay, uses the trainer's URL."""
        deadline = time.monotonic() + self.cfg.fetch_timeout
        relays = {w: info["relay"] for w, info in live.items() if info.get("relay")}
        if not relays:
            self._phase(r, "fetch", set(r.workers), (), deadline=deadline)
            return
        # one host's shared folder: one node
        folders = {w: info.get("fetch_dir", "") for w, info in live.items()}
        # shared/protocol/weights/relay_tree.py
        parent = relay_tree.parents(r.workers, relays, self.cfg.relay_fanout, folders)
        order = relay_tree.order(r.workers, relays)
        depth = relay_tree.depths(parent)
        # workers that acked a verified copy: they can serve it
        have: set[str] = set()
        for level in range(1, max(depth.values()) + 1):
            wave = [w for w in order if depth[w] == level]
            sources = {
                w: f"{relays[parent[w]].rstrip('/')}{PREFIX}{file_name(r.version)}"
                for w in wave
                if parent[w] in have and parent[w] in relays
            }
            r.relayed.update(sources)
            have |= self._phase(r, "fetch", set(wave), tuple(wave), part=str(level), sources=sources, deadline=deadline)
        r.fetch_levels = max(depth.values())

    def _phase(
        self,
        r: "_Round",
        cmd: str,
        awaited: set[str],
        targets: tuple,
        part: str = "",
        sources: dict | None = None,
        deadline: float | None = None,
    ) -> set[str]:
        """Send one command (to ``targets``, or everyone) and wait for the acks of ``awaited``: the workers that
        acked it ok."""
        t0 = time.monotonic()
        cursor = control.last_id(self.client, self.keys)
        weights = cmd in control.WITH_WEIGHTS
        control.send_command(
            self.client,
            self.keys,
            control.Command(
                cmd,
                r.sync,
                r.version,
                r.path if weights else "",
                r.sha256 if weights else "",
                url=r.url if weights else "",
                targets=targets,
                sources=sources or {},
            ),
            part=part,
        )
        # tests only (shared/runtime/faults.py)
        crash_point("syncer", cmd)
        timeout = self.cfg.fetch_timeout if cmd == "fetch" else self.cfg.sync_timeout
        if deadline is not None:
            timeout = max(0.0, deadline - time.monotonic())
        acked, failed, silent, dead = self._wait_acks(r.sync, cmd, awaited - r.missing, cursor, timeout)
        r.durations[f"{cmd}_s"] = r.durations.get(f"{cmd}_s", 0.0) + time.monotonic() - t0
        for worker, error in failed.items():
            r.log.error("worker refused the version; it keeps its old weights", worker=worker, error=error)
        r.refused.update({f"{worker}": f"{cmd}: {error}" for worker, error in failed.items()})
        # the run's own shutdown
        if dead and runstate.ended(runstate.read_meta(self.client, self.keys)):
            r.log.info("workers stopped with the run before acknowledging", cmd=cmd, workers=sorted(dead))
        elif dead:
            r.log.warning(
                "workers died (heartbeat lapsed, or their process on this host gone) before acknowledging; going on "
                "without them",
                cmd=cmd,
                workers=sorted(dead),
            )
        limit = "fetch_timeout" if cmd == "fetch" else "sync_timeout"
        if silent:
            r.log.warning(
                f"workers did not acknowledge within {limit}={timeout:g}s; going on without them",
                cmd=cmd,
                workers=sorted(silent),
            )
        r.why.update({w: f"{cmd}: heartbeat lapsed" for w in dead})
        r.why.update({w: f"{cmd}: silent past {limit}" for w in silent})
        r.missing |= silent | dead
        return acked - set(failed)

    def _wait_acks(self, sync_id: str, cmd: str, workers: set[str], cursor: str, timeout: float):
        """Acks from ``workers`` for (sync, cmd); a worker that dies or stays
        silent past ``timeout`` is returned in ``dead`` or ``silent``."""
        acked: set[str] = set()
        failed: dict[str, str] = {}
        dead: set[str] = set()
        deadline = time.monotonic() + timeout
        next_alive_check = 0.0
        while workers - acked:
            for cursor, entry in control.read_after(self.client, self.keys, cursor, count=1000, block_ms=250):
                # an ack (a duplicate only re-adds the same worker)
                if isinstance(entry, dict):
                    a = control.decode_ack(entry)
                    if a.sync == sync_id and a.cmd == cmd:
                        acked.add(a.worker)
                        if not a.ok:
                            failed[a.worker] = a.error
            now = time.monotonic()
            self._beat()
            if now > deadline:
                break
            # a dead worker's heartbeat key lapses, or, on this host, its process is gone (at once): stop waiting for it
            if now > next_alive_check:
                next_alive_check = now + 0.25
                # EXISTS per awaited worker, not a SCAN of the keyspace
                waiting = sorted(workers - acked)
                pipe = self.client.pipeline(transaction=False)
                for w in waiting:
                    pipe.exists(self.keys.alive("rollout", w))
                dead |= {w for w, alive in zip(waiting, pipe.execute()) if not alive or heartbeat.gone(w)}
                workers -= dead
        return acked, failed, workers - acked, dead

    def _beat(self) -> None:
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + 1.0
            self.heartbeat()
